"""Error feedback on the block-scaled wires: the compressed pipelines' fused encode against the staged one.

``mixprec.compress.flat.encode_with_feedback`` sends a :class:`BlockScaledWire` through its one-pass
``encode_feedback_rows`` (no fp32 staging copy, no decode) and every other compressor through add, encode,
decode, subtract. The two give the same codes; they differ only in the residuals of a call that flagged a block
(the fused pass updates the other blocks' residuals, the staged one none), and such a call clears every residual
(``CompressedCollectives.conclude``; the model does what every rank does). So results and residuals must be the
same bits at every step of a run with a NaN step in the middle: checked here on the one-process model, whose
arithmetic is the pipelines' (``tests/test_reducer_family.py`` checks the model against real gloo runs of the
same reducers, with the same NaN step followed by clean ones).
"""

from __future__ import annotations

import pytest
import torch

import mixprec  # noqa: F401  (registers the compressed reducers)
import mixprec.compress.flat as flat
from mixprec.comm import make_reducer
from mixprec.compress import BlockScaledWire

NAMES = ("mxfp8", "mxfp8_hierarchical", "nvfp4", "nvfp4_hierarchical")
WORLD, NUMEL = 4, 4 * 2048 * 3


class _NotAWire:
    """Stands in for BlockScaledWire in flat's isinstance test: the staged path for every compressor."""


def _rows(step: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(WORLD, NUMEL, generator=g) * torch.exp2(torch.randint(-6, 6, (WORLD, NUMEL), generator=g).float())
    if step == 1:
        x[1, 77] = float("nan")  # one block of rank 1 flagged
    return x.to(dtype)


def _run(name: str, opts: dict, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, fused: bool) -> list:
    """(result, residuals, flagged residuals before the reset) per step of a clean, NaN, clean, clean run."""
    with monkeypatch.context() as m:
        m.setenv("LOCAL_WORLD_SIZE", "2")
        if not fused:
            m.setattr(flat, "BlockScaledWire", _NotAWire)
        calls: list[int] = []
        encode = BlockScaledWire.encode_feedback_rows

        def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(1)
            return encode(self, *args, **kwargs)

        m.setattr(BlockScaledWire, "encode_feedback_rows", counted)
        reducer = make_reducer(name, error_feedback=True, check_finite="flag", **opts)
        steps = []
        for step in range(4):
            out = reducer.model(_rows(step, dtype), average=step != 3, key=0)
            residuals = {k: t.clone() for k, t in reducer.model_state.tensors[0].items()}
            steps.append((out, residuals))
        assert bool(calls) == fused  # the path under test ran
    return steps


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("dtype", "opts"), [(torch.float32, {}), (torch.bfloat16, {"rounding": "stochastic", "seed": 3})]
)
def test_fused_feedback_gives_the_staged_bits_through_a_nan_step(
    name: str, dtype: torch.dtype, opts: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    fused = _run(name, opts, dtype, monkeypatch, fused=True)
    staged = _run(name, opts, dtype, monkeypatch, fused=False)
    for step, ((out_f, res_f), (out_s, res_s)) in enumerate(zip(fused, staged, strict=True)):
        nan = torch.isnan(out_f)
        assert torch.equal(nan, torch.isnan(out_s)), step
        assert torch.equal(out_f[~nan].view(torch.uint8), out_s[~nan].view(torch.uint8)), step
        assert res_f.keys() == res_s.keys() == {"worker", "server"}
        for k in res_f:
            assert torch.equal(res_f[k].view(torch.int32), res_s[k].view(torch.int32)), (step, k)
        if step == 1:
            assert bool(nan.any()) and all(not r.any() for r in res_f.values())  # flagged: every residual cleared
        else:
            assert not bool(nan.any()) and res_f["worker"].any()


def test_a_flagged_block_keeps_its_residual_the_others_move_on() -> None:
    """The documented difference the reset covers: without it, the two paths' residuals would differ."""
    wire = BlockScaledWire("mxfp8_e4m3", chunk_size=64, check_finite="flag")
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(0))
    x[0, 3] = float("nan")
    before = torch.randn(2, 128, generator=torch.Generator().manual_seed(1)) * 1e-3
    fused, staged = before.clone(), before.clone()
    out_f = torch.empty(2, wire.encoded_nbytes(128), dtype=torch.uint8)
    out_s = torch.empty_like(out_f)
    bad = flat.encode_with_feedback(wire, x, fused, out_f, None)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(flat, "BlockScaledWire", _NotAWire)
        assert flat.encode_with_feedback(wire, x, staged, out_s, torch.empty(2, 128)) == bad == 1
    assert torch.equal(out_f, out_s)  # the same codes
    assert torch.equal(staged, before)  # the staged path keeps every residual of a flagged call
    assert torch.equal(fused[0, :32], before[0, :32])  # the flagged block keeps its own
    assert not torch.equal(fused[0, 32:], before[0, 32:]) and not torch.equal(fused[1], before[1])
