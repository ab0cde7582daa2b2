"""mixprec inside torchtitan: FSDP2's reduce-scatter with fp32 accumulation, chosen by the job's config.

Run: python examples/integrations/train_torchtitan.py   (forks 2 CPU ranks on gloo itself; seconds)

torchtitan builds a model, then calls its ModelSpec's ``parallelize_fn``, which applies ``fully_shard``
(``apply_fsdp``, bf16 parameters and, here, a bf16 reduce dtype). ``with_mixprec_reduce(model_spec, config)``
(or ``wrap_parallelize``) makes that function also install mixprec's reduce-scatter: bf16 on the wire, fp32
sums, one rounding. The config comes from a ``[mixprec]`` TOML table. torchtitan itself (0.3.0) needs triton
and a GPU to import its models; this script runs the same wrapping on a stand-in ``parallelize_fn`` with
torchtitan's signature, and checks that it gives the same bits as ``mixprec.fsdp.use_fp32_accumulation``
applied by hand. On GPUs: ``config.model_spec = with_mixprec_reduce(config.model_spec, cfg)`` in a config
function, then ``torchrun --nproc-per-node 8 -m torchtitan.train --module llama3 --config <that function>``.
"""

import tempfile

import torch

from mixprec.integrations.torchtitan import ReduceScatterConfig, wrap_parallelize
from mixprec.testing import run_distributed

WORLD_SIZE = 2
STEPS = 3
TOML = """
[mixprec]
reducer = "fp32_accumulate"
rounding = "stochastic"
seed = 5
device = "cpu"
"""


def parallelize_fn(model: torch.nn.Module, *, parallel_dims=None, training=None, **_: object) -> torch.nn.Module:
    """A stand-in for torchtitan's parallelize_fn: fully_shard each block, then the root, bf16 reduce."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model:
        if any(p.requires_grad for p in block.parameters()):
            fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def train(rank: int, world: int, how: str, config: ReduceScatterConfig) -> list[torch.Tensor]:
    """STEPS SGD steps; ``how``: "wrapped" (the torchtitan adapter), "by_hand" (mixprec.fsdp) or "fsdp"
    (FSDP's own bf16 reduce-scatter)."""
    import mixprec.fsdp

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Tanh(), torch.nn.Linear(40, 8))
    if how == "wrapped":
        model = wrap_parallelize(parallelize_fn, config)(model, parallel_dims=None, training=None)
    else:
        model = parallelize_fn(model)
        if how == "by_hand":
            stream = torch.Generator().manual_seed(config.seed + rank)
            mixprec.fsdp.use_fp32_accumulation(model, rounding=config.rounding, generator=stream)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.randn(6, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def run() -> dict[str, list[torch.Tensor]]:
    import torch._dynamo
    import torch.distributed.fsdp  # noqa: F401

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(TOML)
    config = ReduceScatterConfig.from_toml(f.name)
    return {
        how: run_distributed(train, WORLD_SIZE, how, config, timeout=120)[0] for how in ("wrapped", "by_hand", "fsdp")
    }


def main() -> None:
    out = run()
    same = all(torch.equal(a, b) for a, b in zip(out["wrapped"], out["by_hand"], strict=True))
    differ = not all(torch.equal(a, b) for a, b in zip(out["wrapped"], out["fsdp"], strict=True))
    print(f"wrapped parallelize_fn == mixprec.fsdp by hand, bit for bit: {same}")
    print(f"differs from FSDP's own bf16 reduce-scatter: {differ}")
    assert same
    print("train_torchtitan example: OK")


if __name__ == "__main__":
    main()
