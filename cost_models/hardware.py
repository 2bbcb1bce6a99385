"""Clusters from preset strings, and the link each mesh axis communicates over.

A :class:`Cluster` is ``nodes x devices_per_node`` identical :class:`Device` s joined by
two :class:`Link` s: ``intra`` inside a node (NVLink; TCP loopback for gloo ranks on this
CPU) and ``inter`` between nodes (InfiniBand). Write one as a preset string for :func:`parse_cluster`::

    "4x8xH100"       4 nodes of 8 H100-80GB SXM (DGX H100 links)
    "128xdgx-a100"   128 DGX A100 nodes (8 GPUs each)
    "8xA100"         one node of 8 A100-80GB SXM
    "cpu:4"          this machine's CPU as 4 gloo ranks;  "local" = one rank per core

The devices and links come from ``gpus.py`` (datasheets; every constant cites its source)
and ``cpu.py`` (this machine, measured); their types are in ``devices.py``.

Mesh axes are laid out row-major over ranks ``0 .. world-1`` and ranks
``0 .. devices_per_node-1`` sit on node 0. :func:`axis_link` gives the link one mesh axis
communicates over.

Inter-node model (stated once, used by :func:`axis_link`): ``inter.bandwidth`` is the bus
bandwidth of one whole node's NICs (DGX: 8 NICs, one per GPU, "rail optimized"). All
groups of an axis run their collective at the same time (SPMD), so the node's NICs are
shared by the ``devices_per_node / m`` groups that have ``m`` members on the node; each
group gets ``inter.bandwidth * m / devices_per_node``, and never more than ``intra``
(its members on one node still meet over NVLink). An axis with one rank per node thus gets
one NIC; an axis spanning whole nodes gets all of them (nccl-tests#119: 3 nodes x 4 HDR
NICs reach 85-96 GB/s busbw against 100 GB/s of NICs per node).
"""
from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import replace

from autopar.errors import AutoparInputError

from .cpu import cores, cpu_cluster
from .devices import Cluster, Link
from .gpus import A100_80GB, DEVICES, H100_80GB, NODE_OF_DEVICE, NODES, NodePreset

# A100_80GB and H100_80GB: the presets, also importable from here as before gpus.py
__all__ = ["A100_80GB", "H100_80GB", "Cluster", "ClusterError", "Link", "axis_link",
           "parse_cluster"]


class ClusterError(AutoparInputError):
    """A cluster spec that names no known hardware, or a mesh the cluster cannot hold."""


# --- Parsing -----------------------------------------------------------------------------
_PRESET_HELP = ("'<nodes>x<devices>x<A100|H100|H200|H800>' (e.g. '4x8xH100'), "
                "'<nodes>x<dgx-a100|dgx-h100|dgx-h200|dgx-h800>' (e.g. '128xdgx-a100'), "
                "'<devices>x<A100|H100|H200|H800>' (one node, e.g. '8xA100'), "
                "'cpu:<ranks>' (e.g. 'cpu:4'), 'local'")


def parse_cluster(spec: "str | Cluster") -> Cluster:
    """A :class:`Cluster` from a preset string (or the cluster itself).

    >>> parse_cluster("4x8xH100").world_size
    32
    """
    if isinstance(spec, Cluster):
        return spec
    if not isinstance(spec, str):
        raise ClusterError(f"cluster spec must be a string or Cluster, got {spec!r}; "
                           f"valid presets: {_PRESET_HELP}")
    s = spec.strip().lower()
    if s == "local":
        return _local_cluster(cores(), spec)
    m = re.fullmatch(r"cpu(?::(\d+))?", s)
    if m:
        return _local_cluster(int(m.group(1) or 1), spec)
    m = re.fullmatch(r"(\d+)x(dgx-[a-z0-9]+)", s)
    if m and m.group(2) in NODES:
        return _gpu_cluster(spec, int(m.group(1)), NODES[m.group(2)], None)
    m = re.fullmatch(r"(?:(\d+)x)?(\d+)x([a-z0-9]+?)(?:-80gb|-141gb)?(?:-sxm)?", s)
    if m and m.group(3) in DEVICES:
        node = NODES[NODE_OF_DEVICE[m.group(3)]]
        return _gpu_cluster(spec, int(m.group(1) or 1), node, int(m.group(2)))
    raise ClusterError(f"unknown cluster spec {spec!r}; valid presets: {_PRESET_HELP}; "
                       f"or pass a Cluster")


def _gpu_cluster(spec: str, nodes: int, node: NodePreset, per_node: int | None) -> Cluster:
    per_node = node.devices_per_node if per_node is None else per_node
    if nodes < 1 or per_node < 1:
        raise ClusterError(f"cluster spec {spec!r} has no devices; valid presets: {_PRESET_HELP}")
    return Cluster(name=spec, nodes=nodes, devices_per_node=per_node, device=node.device,
                   intra=node.intra, inter=node.inter)


def _local_cluster(ranks: int, spec: str) -> Cluster:
    if ranks < 1:
        raise ClusterError(f"cluster spec {spec!r} needs at least one rank; "
                           f"valid presets: {_PRESET_HELP}")
    return cpu_cluster(ranks, spec)


def devices_of(cluster: Cluster, world: int) -> Cluster:
    """The first ``world`` devices of ``cluster`` (ranks ``0 .. world-1``, node 0 first), as a
    cluster of their own: the whole of it where ``world`` is its size; on one node where
    ``world`` fits in a node; else whole nodes. CPU ranks are this machine's cores shared by
    ``world`` processes (:func:`cpu_cluster`), so their links are those of ``world`` ranks.

    >>> devices_of(parse_cluster("4x8xH100"), 16).nodes
    2
    """
    if world == cluster.world_size:
        return cluster
    if world < 1 or world > cluster.world_size:
        raise ClusterError(f"world_size={world}: cluster {cluster.name!r} has "
                           f"{cluster.world_size} devices; plan for 1 to {cluster.world_size} "
                           f"of them, or name a larger cluster")
    if cluster.device.name.startswith("cpu"):
        return cpu_cluster(world, f"cpu:{world}")
    if world <= cluster.devices_per_node:
        nodes, per_node = 1, world
    elif world % cluster.devices_per_node:
        raise ClusterError(f"world_size={world}: not whole nodes of cluster {cluster.name!r} "
                           f"({cluster.nodes} nodes x {cluster.devices_per_node} devices); plan "
                           f"for at most {cluster.devices_per_node} devices or a multiple of "
                           f"{cluster.devices_per_node}")
    else:
        nodes, per_node = world // cluster.devices_per_node, cluster.devices_per_node
    # named by a preset string where the device is a preset's, so that the plan's cluster
    # parses back (``plan.cluster``: the report re-prices offload from it)
    key = next((k for k, d in DEVICES.items() if d == cluster.device), None)
    name = f"{nodes}x{per_node}x{key.upper()}" if key else f"{cluster.name} ({world} devices)"
    return replace(cluster, name=name, nodes=nodes, devices_per_node=per_node)


# --- Mesh axes ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def axis_link(cluster: Cluster, mesh_shape: tuple[int, ...], axis: int) -> Link:
    """The link the groups of mesh axis ``axis`` communicate over (see the module
    docstring for the inter-node sharing model)."""
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if math.prod(mesh_shape) != cluster.world_size:
        raise ClusterError(f"mesh {mesh_shape} has {math.prod(mesh_shape)} ranks but cluster "
                           f"{cluster.name!r} has {cluster.world_size}: plan for at most "
                           f"{cluster.world_size} devices (world_size=) or for a larger cluster")
    if not -len(mesh_shape) <= axis < len(mesh_shape):
        raise ValueError(f"axis {axis} out of range for mesh {mesh_shape}")
    axis %= len(mesh_shape)
    size = mesh_shape[axis]
    stride = math.prod(mesh_shape[axis + 1:])
    dpn = cluster.devices_per_node
    if size == 1:
        return cluster.intra
    # The group through its lowest rank r is r + k*stride, k < size. A node boundary may cut
    # groups unevenly, so look at every group; the slowest (fewest members on some node,
    # hence the smallest NIC share) sets the pace of the whole axis.
    m = dpn
    crosses = False
    for start in _group_starts(mesh_shape, axis):
        nodes: dict[int, int] = {}
        for k in range(size):
            n = (start + k * stride) // dpn
            nodes[n] = nodes.get(n, 0) + 1
        if len(nodes) > 1:
            crosses = True
        m = min(m, *nodes.values())
    if not crosses:
        return cluster.intra
    share = cluster.inter.bandwidth * m / dpn
    return Link(bandwidth=min(share, cluster.intra.bandwidth),
                latency=max(cluster.inter.latency, cluster.intra.latency),
                half_bytes=max(cluster.inter.half_bytes, cluster.intra.half_bytes))


def _group_starts(mesh_shape: tuple[int, ...], axis: int):
    """The lowest rank of every group along ``axis`` (its index on ``axis`` is 0)."""
    others = [range(s) if i != axis else range(1) for i, s in enumerate(mesh_shape)]
    strides = [math.prod(mesh_shape[i + 1:]) for i in range(len(mesh_shape))]
    for idx in itertools.product(*others):
        yield sum(i * st for i, st in zip(idx, strides))
