"""mixprec.parallel.GradBuffer through its public methods, on 2 gloo ranks, with the native reducer."""

from __future__ import annotations

import pytest
import torch

from mixprec.parallel import GradBuffer, NativeReducer


def _buffer_case(rank: int, world_size: int, sharded: bool) -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    named = list(model.named_parameters())
    buffer = GradBuffer(named, group=None, bucket_size=20, grad_dtype=None, sharded=sharded)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    for i in range(len(buffer.params)):
        buffer.accumulate(i, sync=True)
    views = all(p.grad is buffer.grad_view(i) for i, p in enumerate(buffer.params))
    for k in range(buffer.num_buckets):
        buffer.bucket(k)[buffer.layout.buckets[k].used :] = float("nan")  # whatever was left there
    handles = [buffer.start_reduction(k, NativeReducer()) for k in range(buffer.num_buckets)]
    for h in handles:
        h.wait()
    buffer.finish_reduction()
    out: dict[str, object] = {
        "views": views,
        "names": [buffer.bucket_names(k) for k in range(buffer.num_buckets)],
        "reduced": buffer.grads_reduced,
        "padding_zero": all(bool((buffer.bucket(k)[b.used :] == 0).all()) for k, b in enumerate(buffer.layout.buckets)),
    }
    if sharded:
        out["shards"] = torch.cat([buffer.shard_grad(k) for k in range(buffer.num_buckets)])
        out["shards_whole"] = torch.equal(out["shards"], buffer.shard_grads)
        out["params_are_views"] = all(
            p.untyped_storage().data_ptr() == buffer.param_bucket(s.bucket).untyped_storage().data_ptr()
            for p, s in zip(buffer.params, buffer.layout.slots, strict=True)
        )
    else:
        out["grads"] = [p.grad.clone() for p in model.parameters()]
        try:
            buffer.shard_grad(0)
        except RuntimeError as exc:
            out["not_sharded"] = str(exc)
    buffer.clear_reduced()
    out["cleared"] = not buffer.grads_reduced
    buffer.zero_grads(set_to_none=True)
    out["zeroed"] = all(bool((buffer.bucket(k) == 0).all()) for k in range(buffer.num_buckets))
    out["none"] = all(p.grad is None for p in model.parameters())
    return out


@pytest.mark.parametrize("sharded", [False, True])
def test_a_gradient_buffer_reduces_and_resets_through_its_public_methods(dist_run, sharded: bool) -> None:
    for r in dist_run(_buffer_case, 2, sharded, timeout=60):
        assert r["views"] and r["reduced"] and r["padding_zero"] and r["cleared"] and r["zeroed"] and r["none"]
        # Reverse registration order, at most 20 parameter elements per bucket (2 + 6 + 3, then 15).
        assert r["names"] == [("1.bias", "1.weight", "0.bias"), ("0.weight",)]
        if sharded:
            assert r["shards_whole"] and r["params_are_views"]
            # Each rank's elements hold the mean of 1 and 2, padding zero (padding was NaN before the start).
            assert set(r["shards"].unique().tolist()) <= {0.0, 1.5}
        else:
            assert all(bool((g == 1.5).all()) for g in r["grads"])
            assert "not sharded" in r["not_sharded"]


def test_bad_arguments_are_named() -> None:
    model = torch.nn.Linear(2, 2)
    named = list(model.named_parameters())
    with pytest.raises(TypeError, match=r"group must be a torch\.distributed ProcessGroup"):
        GradBuffer(named, group="x", bucket_size=10, grad_dtype=None, sharded=False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sharded must be a bool"):
        GradBuffer(named, group=None, bucket_size=10, grad_dtype=None, sharded=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grad_dtype must be one of"):
        GradBuffer(named, group=None, bucket_size=10, grad_dtype=torch.float64, sharded=False)
