"""Topology and its subgroups: they inherit the run's timeout, so a hung rank in a hierarchical collective
makes its peers fail within about that timeout instead of torch's 30-minute default for new groups."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from mixprec.comm import Topology
from mixprec.comm.groups import group_timeout
from mixprec.comm.topology import resolve_topology
from mixprec.compress import MinMaxUInt8, compressed_all_reduce


def _subgroup_timeouts(rank: int, world: int) -> list[timedelta | None]:
    groups = resolve_topology(Topology(2, 2), None)
    # No rank leaves before every rank has finished connecting the new groups (a rank leaving mid-handshake
    # fails its peers' connect with "Connection closed by peer").
    dist.barrier()
    return [group_timeout(None), group_timeout(groups.intra), group_timeout(groups.inter)]


def test_hierarchical_subgroups_get_the_default_groups_timeout(dist_run) -> None:
    for default, intra, inter in dist_run(_subgroup_timeouts, 4, timeout=47):
        assert default == timedelta(seconds=47)
        assert intra == default and inter == default


HANG_TIMEOUT_S = 4.0  # the collectives' timeout in the hang test
# How long the hung rank stays away at most; its peers release it when they give up. Torch's default for new groups
# is 30 minutes: a subgroup without the run's timeout keeps its peers waiting until this runs out.
HUNG_FOR_S = 60.0


def _one_rank_hangs(rank: int, world: int, rendezvous: str, flags: str) -> tuple[str, bool | None]:
    # run_distributed's timeout bounds the whole test; the collectives get a short one of their own.
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=HANG_TIMEOUT_S),
    )
    topology = Topology(2, 2)
    comp = MinMaxUInt8(chunk_size=256)
    compressed_all_reduce(torch.randn(4096), compressor=comp, topology=topology)  # every rank creates the groups
    if rank == 3:
        # Hung: never enters the next collective, and stays connected (leaving would fail the peers at once)
        # until they have given up, or HUNG_FOR_S has passed. Whether they all gave up first is the result.
        deadline = time.monotonic() + HUNG_FOR_S
        while time.monotonic() < deadline and len(os.listdir(flags)) < world - 1:
            time.sleep(0.05)
        return "hung", len(os.listdir(flags)) == world - 1
    try:
        compressed_all_reduce(torch.randn(4096), compressor=comp, topology=topology)
        outcome = "no error"
    except RuntimeError as exc:  # gloo's timeout (DistBackendError is a RuntimeError)
        outcome = f"{type(exc).__name__}: {exc}"
    open(os.path.join(flags, str(rank)), "w").close()
    return outcome, None


def test_hung_rank_in_hierarchical_all_reduce_fails_its_peers_within_the_timeout(dist_run, tmp_path) -> None:
    """The peers give up on their own, by their collectives' timeout, while the hung rank is still hung: causes
    and order, no wall-clock bound (a loaded machine may take longer than the timeout to get there)."""
    flags = tmp_path / "gave_up"
    flags.mkdir()
    res = dist_run(_one_rank_hangs, 4, str(tmp_path / "rendezvous"), str(flags), timeout=HUNG_FOR_S + 60)
    assert res[3] == ("hung", True), res  # every peer gave up before the hung rank came back
    outcomes = [res[rank][0] for rank in range(3)]
    assert "no error" not in outcomes, outcomes
    # The first to give up can only have timed out (the hung rank is still connected); the others may then see
    # that peer's connection close.
    assert any("Timed out" in o for o in outcomes), outcomes
