"""Which mesh axis plays which part, as one value.

A plan's mesh has named axes (``Plan.mesh_axes``); the solver and the pricing read them
through their roles: the data-parallel axis (batch split, parameters whole or ZeRO-sharded),
the tensor-parallel axis (weights split), the expert-parallel axis (experts split, tokens
dispatched to them), the context-parallel axis (the sequence split through attention), the
pipeline axis (stages) and the branch axis (parallel branches). :class:`MeshRoles` holds the
index of each on one mesh (None: the mesh has no such axis) and how experts are dispatched
(``expert_dispatch``), so a new axis is one field here rather than one more keyword through
every function that builds or prices a problem.

The axis names are the fields' names, and every list of them is derived from here:
``AXIS_NAMES`` (every axis a pin sizes: ``options.MESH_AXIS_PINS`` is it, and what reads
every mesh pin, ``autopar.elastic``'s re-plan for a new world size, sees a new axis through
it) and ``STAGE_AXES`` (the axes of one stage's mesh, outer to inner: the order
``solver.meshes`` lays a pinned mesh out in).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Mapping, Sequence

@dataclass(frozen=True)
class MeshRoles:
    """The index of each role's axis on one mesh (None: no such axis), and the experts'
    dispatch (``"all-to-all"``, ``"all-gather"``, ``"tensor"`` or None: the solver
    chooses). Hashable: the solver keys its problems and programs by it."""
    data: int | None = None
    context: int | None = None
    expert: int | None = None
    tensor: int | None = None
    pipeline: int | None = None
    branch: int | None = None
    dispatch: str | None = None

    @classmethod
    def of_axes(cls, axes: Sequence[str], dispatch: str | None = None) -> MeshRoles:
        """The roles of a mesh whose axes are named ``axes`` (``Plan.mesh_axes``); names
        that are no role (``"axis0"`` of a mesh the solver chose freely) play none."""
        axes = list(axes)
        return cls(**{n: axes.index(n) for n in AXIS_NAMES if n in axes}, dispatch=dispatch)

    @classmethod
    def of_plan(cls, plan) -> MeshRoles:
        """The roles of ``plan``'s mesh, its pinned expert dispatch among them."""
        return cls.of_axes(plan.mesh_axes, plan.options.expert_dispatch)

    @classmethod
    def lay_out(cls, sizes: Mapping[str, int]) -> tuple[tuple[int, ...], MeshRoles]:
        """(mesh shape, roles) of a stage mesh with ``sizes`` devices on each named axis
        (``STAGE_AXES``; missing: 1): an axis for each size above 1, in ``STAGE_AXES``
        order, and the data axis alone when every size is 1 (one device)."""
        unknown = set(sizes) - set(STAGE_AXES)
        if unknown:
            raise ValueError(f"lay_out sizes name {sorted(unknown)}, not axes of a stage mesh; "
                             f"use names of {STAGE_AXES}")
        shape, roles = [], {}
        for name in STAGE_AXES:
            n = sizes.get(name, 1)
            if n > 1 or (name == "data" and all(sizes.get(m, 1) == 1 for m in STAGE_AXES)):
                roles[name] = len(shape)
                shape.append(n)
        return tuple(shape), cls(**roles)

    def axis_names(self, ndim: int) -> tuple[str, ...]:
        """The names of a mesh of ``ndim`` axes with these roles (``Plan.mesh_axes``): each
        role's axis under the role's name, any other ``axis{i}``."""
        names = [f"axis{i}" for i in range(ndim)]
        for name in AXIS_NAMES:
            a = getattr(self, name)
            if a is not None:
                if not 0 <= a < ndim:
                    raise ValueError(f"the {name} axis is {a}, outside a mesh of {ndim} axes")
                names[a] = name
        return tuple(names)

    def degree(self, name: str, mesh_shape: Sequence[int]) -> int:
        """Devices on the ``name`` axis of a mesh of ``mesh_shape`` (1 without one)."""
        a = getattr(self, name)
        return 1 if a is None else int(mesh_shape[a])

    def with_dispatch(self, dispatch: str | None) -> MeshRoles:
        return replace(self, dispatch=dispatch)


AXIS_NAMES = tuple(f.name for f in fields(MeshRoles) if f.name != "dispatch")
"""Every mesh axis a pin sizes (``data=``, ``context=``, ... ``branch=``), under the name
``Plan.mesh_axes`` gives it: :class:`MeshRoles`' fields, in their order."""

WHOLE_PLAN_AXES = ("pipeline", "branch")
"""The axes that split a plan into stages or branches, each with a stage mesh of its own."""

STAGE_AXES = tuple(n for n in AXIS_NAMES if n not in WHOLE_PLAN_AXES)
"""The axes of one stage's mesh, outer to inner (``data``, ``context``, ``expert``,
``tensor``): tensor parallelism innermost (inside a node, on NVLink, as Megatron-LM keeps
it), context next to it (Llama 3's long-context layout)."""

NO_ROLES = MeshRoles()
"""A mesh with no axis pinned to a role: the solver chooses per op what each axis does."""
