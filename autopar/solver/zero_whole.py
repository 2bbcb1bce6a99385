"""Parameters that ZeRO leaves whole on every data rank, named where nothing fits.

autopar shards a parameter under ZeRO (stages 1-3) along one of its dims in equal blocks,
one per data rank (``pricing.problem.placeholder_options``: only placements that divide
evenly; ``passes/shard_parameters`` cuts them with ``chunk``). A parameter none of whose
dims the data degree divides has no such block, so ``pricing.problem._apply_pins`` keeps it
replicated on the data axis: its parameters, gradients and optimizer state count whole on
every rank, which is right for a bias of odd length and wrong by orders of magnitude for a
model whose every dim misses a factor of the data degree. Narayanan et al. 2021, Table 2
ran 529.6B (h 20,480 = 2^12 x 5) under DeepSpeed's ZeRO-3 on 1,120 and 2,240 GPUs
(2^5 x 5 x 7 and 2^6 x 5 x 7): no dim of any of its weights has the factor 7, so every
parameter stayed whole and the least-memory plan needed 7,892 GiB a GPU (5,919 GiB of it
optimizer state) "under zero=3". DeepSpeed pads each flattened parameter to a multiple of the data degree
before partitioning (``deepspeed/runtime/zero/partition_parameters.py``,
``Init._padding_size``: ``world_size - numel % world_size``), so any degree shards;
autopar's runtime has no padded shards yet, so the plan cannot either, and the
infeasibility message says which parameters stay whole and why instead of blaming the
budget (:func:`whole_note`).
"""
from __future__ import annotations

import math

from autopar.placement import Shard


def whole_under_zero(problem, data_axis: int) -> list[tuple[str, tuple, int]]:
    """(placeholder, shape, elements over its repeated-layer members) of every parameter of
    ``problem`` with no option sharded on ``data_axis``, the largest first."""
    out = []
    for v in problem.vars.values():
        if v.kind != "param" or v.meta is None:
            continue
        if any(isinstance(o[data_axis].outputs[0], Shard) for o in v.options):
            continue
        out.append((v.name, tuple(v.meta.shape), math.prod(v.meta.shape) * max(1, len(v.members))))
    return sorted(out, key=lambda t: -t[2])


def dividing_degree(shapes: list[tuple], data: int) -> int:
    """The largest divisor of ``data`` that divides some dim of every shape in ``shapes``
    (1 when only that does)."""
    for d in sorted((d for d in range(1, data + 1) if data % d == 0), reverse=True):
        if all(any(n % d == 0 for n in shape) for shape in shapes):
            return d
    return 1


def whole_note(problem, data_axis: int, zero: int) -> str | None:
    """The infeasibility message's line on the parameters ``zero`` leaves whole on the data
    axis of ``problem``'s mesh (None when every parameter of more than 1% of the model's
    elements is sharded there)."""
    if zero < 1 or data_axis is None:
        return None
    data = problem.mesh_shape[data_axis]
    total = sum(math.prod(v.meta.shape) * max(1, len(v.members))
                for v in problem.vars.values() if v.kind == "param" and v.meta is not None)
    whole = whole_under_zero(problem, data_axis)
    numel = sum(n for _, _, n in whole)
    if not whole or numel <= 0.01 * total:
        return None
    count = sum(max(1, len(problem.vars[n].members)) for n, _, _ in whole)
    name, shape, _ = whole[0]
    names = problem.param_names.get(name, [name])
    d = dividing_degree([s for _, s, _ in whole], data)
    fix = (f"a data degree that divides a dim of each (of {data}'s divisors, {d} does: the rest of "
           "the devices to tensor= or pipeline=)" if d > 1 else
           "a data degree that divides a dim of each")
    return (f"zero={zero} leaves {count} parameter(s) whole on every data rank, {numel:,} of "
            f"the model's {total:,} elements ({numel / total:.0%}): no dim of theirs divides the "
            f"data degree {data} (largest: {names[0]!r} {list(shape)}). autopar shards a parameter "
            f"along one dim in equal blocks; DeepSpeed pads a flattened one, which autopar does "
            f"not yet. Fix: {fix}, or pad the model's dims to a multiple of {data}")
