"""mixprec inside torchtitan: the wrapped ``parallelize_fn`` installs FSDP2's fp32-accumulating reduce-scatter.

torchtitan 0.3.0 imports triton (and so needs a GPU build) to load its models, so the package itself is not
run here: examples/integrations/train_torchtitan.py wraps a stand-in ``parallelize_fn`` of torchtitan's shape
(fully_shard per block, bf16 parameters and reduce dtype) with a config read from a ``[mixprec]`` TOML table,
trains 3 steps on 2 gloo ranks and must give the bits of ``mixprec.fsdp.use_fp32_accumulation`` applied by
hand with the same stochastic stream (itself checked against an fp32 oracle in tests/test_fsdp.py), and not
those of FSDP's own bf16 reduce-scatter.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from mixprec.integrations.torchtitan import ReduceScatterConfig, install, with_mixprec_reduce, wrap_parallelize

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "integrations" / "train_torchtitan.py"


@pytest.mark.slow
def test_wrapped_parallelize_fn_gives_mixprec_fsdp_bits() -> None:
    spec = importlib.util.spec_from_file_location("train_torchtitan", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = example.run()
    assert all(torch.equal(a, b) for a, b in zip(out["wrapped"], out["by_hand"], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(out["wrapped"], out["fsdp"], strict=True))


def test_config_from_toml_and_its_refusals(tmp_path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('[job]\nname = "x"\n[mixprec]\nrounding = "stochastic"\nseed = 3\n')
    assert ReduceScatterConfig.from_toml(path) == ReduceScatterConfig(rounding="stochastic", seed=3)
    with pytest.raises(ValueError, match="no \\[other\\] table"):
        ReduceScatterConfig.from_toml(path, section="other")
    with pytest.raises(ValueError, match="only 'fp32_accumulate' can"):
        ReduceScatterConfig(reducer="uint8")
    with pytest.raises(TypeError, match="unknown mixprec setting"):
        ReduceScatterConfig.from_dict({"rouding": "nearest"})
    with pytest.raises(ValueError, match="rounding must be one of"):
        ReduceScatterConfig(rounding="up")
    with pytest.raises(ValueError, match="only with hierarchical"):
        ReduceScatterConfig(inter_node_dtype="float32")


def test_a_model_without_fsdp_is_refused() -> None:
    with pytest.raises(ValueError, match="data_parallel_shard_degree > 1"):
        install(torch.nn.Linear(2, 2), ReduceScatterConfig())
    with pytest.raises(ValueError, match="data_parallel_shard_degree > 1"):
        wrap_parallelize(lambda m, **kw: m, ReduceScatterConfig())(torch.nn.Linear(2, 2), parallel_dims=None)


def test_model_spec_is_copied_and_not_wrapped_twice() -> None:
    @dataclasses.dataclass
    class ModelSpec:  # torchtitan's ModelSpec's field that matters here
        name: str
        parallelize_fn: object

    def parallelize(model, **kwargs):
        return model

    spec = ModelSpec("llama3", parallelize)
    wrapped = with_mixprec_reduce(spec, ReduceScatterConfig())
    assert spec.parallelize_fn is parallelize and wrapped.parallelize_fn.__wrapped__ is parallelize
    with pytest.raises(ValueError, match="already installs"):
        with_mixprec_reduce(wrapped, ReduceScatterConfig())
    with pytest.raises(TypeError, match="ModelSpec"):
        with_mixprec_reduce(parallelize, ReduceScatterConfig())
