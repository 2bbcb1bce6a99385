"""The device meshes the solver tries for a world of devices, as the pins and
``mesh_shape`` allow: the 1-D mesh and the 2-D meshes ``(world / t, t)``. On one node every
factorisation; across nodes the inner axis (consecutive ranks) stays inside a node, t
dividing the node's devices (2, 4, 8 on a DGX), as Megatron-LM keeps tensor parallelism on
NVLink: an axis that crosses nodes on both sides is never faster, and 2,520 devices would
otherwise give 46 meshes to solve."""
from __future__ import annotations

import math

from autopar.errors import ArgumentError, PinError
from autopar.mesh_roles import NO_ROLES, MeshRoles
from autopar.options import Options, as_options


def mesh_candidates(world: int, pins: Options, mesh_shape, devices_per_node: int | None = None
                    ) -> list[tuple[tuple[int, ...], tuple[str, ...], MeshRoles]]:
    """(mesh shape, axis names, the axes' :class:`MeshRoles`) to try; ``devices_per_node``
    (None: one node) bounds the inner axis of a 2-D mesh across nodes."""
    if mesh_shape is not None:
        mesh_shape = tuple(int(n) for n in mesh_shape)
        prod = math.prod(mesh_shape)
        if prod != world:
            raise ArgumentError(f"mesh_shape {mesh_shape} has {prod} devices but the world has "
                                f"{world}; use a mesh whose product is {world}")
    pins = as_options(pins)
    out = _meshes(world, pins, mesh_shape, devices_per_node)
    return [(shape, roles.axis_names(len(shape)), roles.with_dispatch(pins.expert_dispatch))
            for shape, roles in out]


def _meshes(world, pins: Options, mesh_shape, devices_per_node) -> list[tuple[tuple, MeshRoles]]:
    """(mesh shape, roles) to try: the pinned mesh, the data axis under a ZeRO pin, or the
    free meshes (no roles: the solver chooses per op what each axis does)."""
    if pins.data is not None or pins.tensor is not None or (pins.expert or 1) > 1 \
            or (pins.context or 1) > 1:
        return [_pinned_mesh(world, pins, mesh_shape)]
    if pins.zero:
        return [((world,), MeshRoles(data=0))]
    if mesh_shape is not None:
        return [(mesh_shape, NO_ROLES)]
    out = [((world,), NO_ROLES)]
    within = devices_per_node if devices_per_node and world > devices_per_node else world
    for a in range(2, world):
        if world % a == 0 and world // a >= 2 and within % (world // a) == 0:
            out.append(((a, world // a), NO_ROLES))
    return out


def _pinned_mesh(world: int, pins: Options, mesh_shape):
    """(shape, roles) of the one mesh the ``data=`` / ``tensor=`` / ``expert=`` /
    ``context=`` pins give: axes data, context, expert, tensor, outer to inner
    (``MeshRoles.lay_out``)."""
    data, tensor, expert, context = pins.data, pins.tensor, pins.expert or 1, pins.context or 1
    for name, n in (("expert", expert), ("context", context)):
        if world % n:
            raise PinError(f"pin {name}={n} does not divide the world size {world}: pin a "
                           f"{name}-parallel degree that divides {world}")
    if world % (expert * context):
        raise PinError(f"pins expert={expert} and context={context} do not divide the world "
                       f"size {world} together")
    rest = world // (expert * context)
    if data is None and tensor is None:
        data, tensor = rest, 1
    if data is None:
        data = rest // tensor if rest % tensor == 0 else None
    if tensor is None:
        tensor = rest // data if rest % data == 0 else None
    if data is None or tensor is None or data * tensor != rest:
        ex = (f" expert={expert}" if expert > 1 else "") + (f" context={context}" if context > 1 else "")
        raise PinError(f"pins data={pins.data} tensor={pins.tensor}{ex} do not "
                       f"multiply to the world size {world}: pin data and tensor whose product "
                       f"is {rest}, or plan for data x tensor devices (world_size=)")
    shape, roles = MeshRoles.lay_out(dict(data=data, context=context, expert=expert, tensor=tensor))
    if mesh_shape is not None and shape != mesh_shape:
        raise PinError(f"mesh_shape {mesh_shape} disagrees with pins data={data} tensor={tensor}")
    return shape, roles
