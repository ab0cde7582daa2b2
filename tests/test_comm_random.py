"""mixprec.comm.rank_generator: one stream per (seed, device, rank), created lazily, never inherited by fork."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mixprec.comm import DEFAULT_STOCHASTIC_SEED, rank_generator
from mixprec.core.random import rank_stream, rounding_generator


def _first_draws(seed: int, n: int = 8) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_same_arguments_give_the_same_generator_and_devices_are_canonical() -> None:
    g = rank_generator(123_456)
    assert g is rank_generator(123_456, "cpu") is rank_generator(123_456, torch.device("cpu"))
    assert g is not rank_generator(123_457)
    assert g.device == torch.device("cpu")
    # Not distributed: rank 0, so the stream starts as a generator seeded with the seed itself.
    fresh = rank_generator(98_765)
    assert torch.equal(torch.rand(8, generator=fresh, dtype=torch.float64), _first_draws(98_765))


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="seed must be an int"):
        rank_generator(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed must be an int"):
        rank_generator(True)
    with pytest.raises(ValueError, match="outside torch's seed range"):
        rank_generator(2**64)
    with pytest.raises(RuntimeError, match="init_process_group"):
        rank_generator(1, group=object())  # type: ignore[arg-type]


def _ranks_case(rank: int, world_size: int, seed: int) -> dict[str, object]:
    g = rank_generator(seed)
    draws = torch.rand(8, generator=g, dtype=torch.float64)
    subgroup = dist.new_group([1, 2])
    in_group = rank_generator(seed, group=subgroup) if rank in (1, 2) else None
    # Rank 0 is not in the subgroup and would otherwise tear its group down while ranks 1 and 2 are
    # still connecting theirs through the shared store (seen in CI as "Connection closed by peer").
    dist.barrier()
    return {
        "draws": draws,
        "same_object": g is rank_generator(seed, "cpu"),
        "group_seed_draw": None if in_group is None else torch.rand(8, generator=in_group, dtype=torch.float64),
    }


def test_each_rank_and_each_forked_child_gets_its_own_seeded_stream(dist_run) -> None:
    seed = 4242
    # Created and advanced in the parent before the fork: a pid-blind cache would hand this very object
    # (mid-stream, with rank 0's seed) to every child.
    parent = rank_generator(seed)
    torch.rand(100, generator=parent)
    results = dist_run(_ranks_case, 3, seed, timeout=60)
    for rank, r in enumerate(results):
        assert r["same_object"]
        assert torch.equal(r["draws"], _first_draws(seed + rank))
    # A group's rank is the rank within it: global ranks 1 and 2 are ranks 0 and 1 of the subgroup.
    assert results[0]["group_seed_draw"] is None
    assert torch.equal(results[1]["group_seed_draw"], _first_draws(seed + 0))
    assert torch.equal(results[2]["group_seed_draw"], _first_draws(seed + 1))


def test_rounding_generator_is_the_given_stream_else_the_ranks() -> None:
    given = torch.Generator().manual_seed(5)
    assert rounding_generator("nearest", None, "cpu") is None  # nothing drawn: no stream created
    assert rounding_generator("nearest", given, "cpu") is given
    assert rounding_generator("stochastic", given, "cpu", 77) is given
    assert rounding_generator("stochastic", None, "cpu") is rank_generator(DEFAULT_STOCHASTIC_SEED, "cpu")
    assert rounding_generator("stochastic", None, torch.device("cpu"), 31_337) is rank_generator(31_337)


def test_rank_stream_is_the_seeding_rule_of_rank_generator() -> None:
    # Rank 0 outside a distributed run: a fresh rank_generator and rank_stream(seed, dev, 0) draw alike, and
    # rank r's stream starts where a generator seeded seed + r does (what each forked rank checks above).
    assert torch.equal(
        torch.rand(8, generator=rank_stream(55_555, "cpu", 0)), torch.rand(8, generator=rank_generator(55_555))
    )
    assert torch.equal(torch.rand(8, generator=rank_stream(55_555, None, 3), dtype=torch.float64), _first_draws(55_558))
    assert rank_stream(1, "cpu", 0) is not rank_stream(1, "cpu", 0)  # fresh each time, unlike rank_generator


def test_only_core_random_resolves_a_rank_stream() -> None:
    """Every stochastic-rounding path of mixprec asks rounding_generator (a real rank) or rank_stream (a model of
    P ranks): no other module calls rank_generator itself."""
    src = Path(__file__).resolve().parents[1] / "src" / "mixprec"
    calls = []
    for path in src.rglob("*.py"):
        if path == src / "core" / "random.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                if name == "rank_generator":
                    calls.append(f"{path.relative_to(src)}:{node.lineno}")
    assert not calls, calls
