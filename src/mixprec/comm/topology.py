"""Node topology for hierarchical compressed collectives: which ranks share a fast (intra-node) link.

Ranks are numbered node-major, as torchrun assigns them: ``rank = node * ranks_per_node + local``. From a
:class:`Topology` the intra-node groups (one per node) and the inter-node groups (one per local index: the
ranks with the same local rank on every node) are created once with :func:`mixprec.comm.groups.new_group`
(the default group's timeout, not torch's 30 minutes) and cached per (process group, topology): every rank
creates every subgroup, in the same order, the first time a topology is used, so the first hierarchical
call must be made by all ranks of the default group together. A 2-D ``DeviceMesh`` with dims
``("node", "local")`` supplies its own groups instead.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from mixprec.comm.groups import new_group
from mixprec.core.validate import check_positive_int

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """``nodes`` machines with ``ranks_per_node`` ranks each, ranks numbered node-major.

    Args:
        nodes: number of nodes (machines), int >= 1.
        ranks_per_node: ranks on each node, int >= 1 (torchrun's ``LOCAL_WORLD_SIZE``).
    """

    nodes: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        check_positive_int("nodes", self.nodes)
        check_positive_int("ranks_per_node", self.ranks_per_node)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @classmethod
    def from_env(cls, world_size: int | None = None) -> Topology:
        """From torchrun's ``LOCAL_WORLD_SIZE`` (ranks per node) and the world size (default: the default
        group's). Raises ValueError when ``LOCAL_WORLD_SIZE`` is unset or does not divide the world size.
        """
        per_node = local_world_size_from_env()
        if world_size is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("Topology.from_env() needs world_size or an initialised process group")
            world_size = dist.get_world_size()
        if per_node < 1 or world_size % per_node:
            raise ValueError(f"LOCAL_WORLD_SIZE={per_node} does not divide the world size {world_size}")
        return cls(world_size // per_node, per_node)


def local_world_size_from_env() -> int:
    """torchrun's ``LOCAL_WORLD_SIZE`` (ranks per node); ValueError when it is unset or not an integer."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        raise ValueError(
            "no topology given and LOCAL_WORLD_SIZE is not set (torchrun sets it): pass "
            "topology=Topology(nodes, ranks_per_node) or a 2-D DeviceMesh with dims ('node', 'local')"
        )
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE must be an integer; got {value!r}") from None


@dataclass(frozen=True)
class HierarchicalGroups:
    """The two subgroups a rank uses, and its place in the topology."""

    intra: dist.ProcessGroup  # this rank's node, ordered by local rank
    inter: dist.ProcessGroup  # the ranks with this rank's local index, ordered by node
    nodes: int
    ranks_per_node: int
    node: int
    local: int


# (id of the parent group, nodes, ranks_per_node) -> (parent group, kept alive so its id is not reused; groups)
_CACHE: dict[tuple[int, int, int], tuple[Any, HierarchicalGroups]] = {}


def _is_device_mesh(obj: object) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without device_mesh
        return False
    return isinstance(obj, DeviceMesh)


def check_topology(topology: object, group: dist.ProcessGroup | None = None) -> Topology | Any:
    """Validate ``topology`` without creating any process group: a :class:`Topology` or a 2-D DeviceMesh
    with dims ("node", "local") numbering its ranks node-major. When torch.distributed is initialised, its
    size must also match the default group and ``group`` must span the default group.

    Raises:
        TypeError: not a Topology nor a DeviceMesh.
        ValueError: a mesh of the wrong shape or names, or sizes that do not match the group.
    """
    if _is_device_mesh(topology):
        mesh: Any = topology
        if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != ("node", "local"):
            raise ValueError(
                f"a DeviceMesh topology must be 2-D with mesh_dim_names ('node', 'local'); got {mesh.ndim}-D "
                f"with names {mesh.mesh_dim_names}"
            )
        # Node-major numbering is what makes local rank l of every node hold the same slice.
        if mesh.mesh.flatten().tolist() != list(range(mesh.mesh.numel())):
            raise ValueError(
                "the DeviceMesh must number ranks node-major over the whole group (mesh == arange(world).view("
                f"nodes, ranks_per_node)); got {mesh.mesh.tolist()}"
            )
        size = mesh.mesh.numel()
    elif isinstance(topology, Topology):
        size = topology.world_size
    else:
        raise TypeError(
            "topology must be a mixprec.comm.Topology, a 2-D DeviceMesh with dims ('node', 'local'), or "
            f"None; got {type(topology).__name__}"
        )
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if group is not None and dist.get_world_size(group) != world:
            raise ValueError(
                "a hierarchical topology needs group=None (the default group); for a sub-group, build a 2-D "
                "DeviceMesh over its ranks with dims ('node', 'local') and pass it as topology"
            )
        if size != world:
            shape = (
                f"{topology.nodes} nodes x {topology.ranks_per_node} ranks"
                if isinstance(topology, Topology)
                else f"a DeviceMesh of shape {tuple(topology.mesh.shape)}"  # type: ignore[attr-defined]
            )
            raise ValueError(f"topology has {shape} = {size} ranks but the group has {world}")
    return topology


def resolve_topology(topology: object, group: dist.ProcessGroup | None) -> HierarchicalGroups:
    """Subgroups for ``topology`` (a :class:`Topology` or a 2-D DeviceMesh) over ``group``.

    ``group`` must be the default (world) group: the subgroups are created by every rank of it.
    """
    check_topology(topology, group)
    if _is_device_mesh(topology):
        return _from_mesh(topology)
    if not isinstance(topology, Topology):  # check_topology raised already; for the type checker
        raise TypeError(f"topology must be a mixprec.comm.Topology; got {type(topology).__name__}")
    parent = dist.group.WORLD
    key = (id(parent), topology.nodes, topology.ranks_per_node)
    cached = _CACHE.get(key)
    if cached is not None:
        return cached[1]
    n = topology.ranks_per_node
    rank = dist.get_rank()
    intra = _own_subgroup([[node * n + local for local in range(n)] for node in range(topology.nodes)], rank)
    inter = _own_subgroup([[node * n + local for node in range(topology.nodes)] for local in range(n)], rank)
    groups = HierarchicalGroups(intra, inter, topology.nodes, n, rank // n, rank % n)
    _CACHE[key] = (parent, groups)
    return groups


def _own_subgroup(partition: Sequence[Sequence[int]], rank: int) -> dist.ProcessGroup:
    """Create every group of ``partition`` (a collective call: all ranks, same order) and return ``rank``'s."""
    own = None
    for ranks in partition:
        group = new_group(ranks)
        if rank in ranks:
            own = group
    if own is None:  # the partitions above cover every rank of the default group
        raise RuntimeError(f"internal: rank {rank} is in no group of {partition}")
    return own


def _from_mesh(mesh: Any) -> HierarchicalGroups:
    nodes, per_node = mesh.mesh.shape
    rank = dist.get_rank()
    return HierarchicalGroups(
        mesh.get_group("local"), mesh.get_group("node"), int(nodes), int(per_node), rank // per_node, rank % per_node
    )
