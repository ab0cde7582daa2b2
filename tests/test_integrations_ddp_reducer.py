"""The generic DDP comm hook (``mixprec.integrations.ddp_reducer``) on buckets whose length is not a multiple
of lcm(world, 128): torch DDP + ``reducer_hook`` gives each step's gradients with the bits of mixprec's own
DistributedDataParallel, whose buckets are padded the same way (zeros after the last element)."""

from __future__ import annotations

import pytest
import torch

from mixprec.testing import run_distributed

# name -> (options, parameter dtype, bias): fp32_accumulate is elementwise, so two parameters (whose order in
# the bucket differs between torch DDP and the wrapper) give the same bits; uint8's chunks need one parameter.
CASES = {
    "fp32_accumulate": ({}, torch.bfloat16, True),
    "uint8": ({"chunk_size": 32, "error_feedback": True, "rounding": "stochastic", "seed": 3}, torch.float32, False),
}


def _grads(rank: int, world: int) -> dict:
    from mixprec.comm import rank_generator
    from mixprec.integrations.ddp_reducer import ReducerHookState, reducer_hook
    from mixprec.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    out: dict = {}
    for name, (options, dtype, bias) in CASES.items():
        for consumer in ("hook", "wrapper"):
            if "seed" in options:  # one stream per seed and process: start it afresh for each consumer
                rank_generator(options["seed"]).manual_seed(options["seed"] + rank)
            torch.manual_seed(0)
            net = torch.nn.Linear(5, 7, bias=bias).to(dtype)  # 35 (+ 7) elements: padded to 128
            if consumer == "hook":
                wrapped = torch.nn.parallel.DistributedDataParallel(net)
                state = ReducerHookState(name, **options)
                wrapped.register_comm_hook(state, reducer_hook)
            else:
                wrapped = DistributedDataParallel(net, reduce=name, reduce_options=options)
            opt = torch.optim.SGD(net.parameters(), lr=0.5)
            steps = []
            for step in range(3):
                x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank)).to(dtype)
                opt.zero_grad()
                wrapped(x).float().square().mean().backward()
                steps.append([p.grad.clone() for p in net.parameters()])
                opt.step()
            out[name, consumer] = steps
    return out


@pytest.mark.slow
def test_reducer_hook_pads_like_the_wrapper() -> None:
    per_rank = run_distributed(_grads, 2, timeout=240)
    for name in CASES:
        for r, result in enumerate(per_rank):
            for step, (hooked, wrapped) in enumerate(zip(result[name, "hook"], result[name, "wrapper"], strict=True)):
                for a, b in zip(hooked, wrapped, strict=True):
                    assert a.dtype == b.dtype and torch.equal(a, b), (name, r, step)
        assert all(torch.equal(a, b) for a, b in zip(per_rank[0][name, "hook"][2], per_rank[1][name, "hook"][2]))


def test_hook_state_refuses_bad_input() -> None:
    from mixprec.integrations.ddp_reducer import ReducerHookState, reducer_hook

    with pytest.raises(RuntimeError, match="init_process_group"):
        ReducerHookState("uint8")
    with pytest.raises(TypeError, match="ReducerHookState"):
        reducer_hook(None, None)
