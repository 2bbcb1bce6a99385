"""The free search's context stage: context parallelism (``context=c``) weighed against the
plans without it, for models whose attention runs over long sequences.

Where: a graph with self-attention (``scaled_dot_product_attention`` with as many keys as
queries) over at least :data:`LONG_SEQUENCE` positions, and no pin that excludes a context
axis. Below that length attention's ``s^2`` work and activations are small next to the
rest, and splitting the sequence only adds transfers, so the search does not spend its
solves there (Llama 3 kept 8k tokens without it and moved to context parallelism for its
long-context stage: Dubey et al., "The Llama 3 Herd of Models", 2024, Sec. 3.3.2).

What: each context degree ``c`` (2, 4, 8, ... up to the world, the batch split over the
rest as data parallelism where it divides), with tensor parallelism inside a node (the
``tensor=`` pin, else a node's devices when they divide what is left, else none), planned
as if pinned (``flat.plan_captured`` on the graph in the balanced order:
``autopar.capture.sequence_layout``) and offered to the one comparison; the plan records
``context=`` and ``tensor=`` in its options, as a search's ZeRO stage is.
"""
from __future__ import annotations

import copy
import math

import torch

from autopar.capture.sequence_layout import balance_sequence
from autopar.errors import PinError
from autopar.ops.attention import is_attention
from autopar.options import Options
from autopar.solver.errors import InfeasibleError
from autopar.solver.flat import mesh_floor

LONG_SEQUENCE = 16384
"""Positions from which the free search weighs a context axis (module docstring)."""


def long_attention(cap) -> int | None:
    """The sequence length of ``cap``'s self-attention when it is long enough to weigh a
    context axis (the first input's dim 1, matched by an SDPA's queries and keys)."""
    first = cap.node(cap.inputs[0]).meta.get("val")
    if not isinstance(first, torch.Tensor) or first.dim() < 2 or first.shape[1] < LONG_SEQUENCE:
        return None
    seq = int(first.shape[1])
    for n in cap.gm.graph.nodes:
        if is_attention(n.target):
            q, k = n.args[0].meta["val"], n.args[1].meta["val"]
            if q.shape[-2] == k.shape[-2] == seq:
                return seq
    return None


def context_candidates(pins: Options, world: int, batch: int, devices_per_node: int,
                       seq: int) -> list[tuple[int, int]]:
    """(context, tensor) degrees to plan (module docstring)."""
    if any((getattr(pins, n) or 1) > 1 for n in ("context", "expert", "branch", "pipeline")) \
            or pins.compile or pins.zero or pins.compress not in (None, "none") or pins.local_sgd:
        return []
    out = []
    c = 2
    while c <= world and seq % (2 * c) == 0:
        rest = world // c if world % c == 0 else 0
        t = pins.tensor or (devices_per_node if rest and rest % devices_per_node == 0 else 1)
        if rest and rest % t == 0:
            d = rest // t
            if (pins.data is None or pins.data == d) and batch % d == 0:
                out.append((c, t))
        c *= 2
    return out


def balanced_copy(cap, c: int):
    """A copy of ``cap`` with its token stream in the balanced order of ``c`` ranks (what a
    capture under ``sequence_layout(c)`` gives)."""
    twin = copy.copy(cap)
    twin.gm = copy.deepcopy(cap.gm)
    twin.__post_init__()
    return balance_sequence(twin, c)


def search_context(spec, cap, plan_with, best_s: float | None = None, notes: list | None = None):
    """The context plans of :func:`context_candidates`: [(Plan, its graph)] that fit.
    ``plan_with(graph, pins, cutoff_s, pruned)``: the unpipelined plan of a graph under
    pins (the free search's, ``flat.solve_ask`` of its ask), its programs whose compute
    floor or LP relaxation is at least ``cutoff_s`` left unsolved and added to ``pruned``
    (``MeshAsk.cutoff_s``: exact, no plan on them beats it). ``best_s``: the best step the
    search has found, the cutoff, lowered by each context plan found; a degree whose
    compute floor (``flat.mesh_floor``) is at least it is not planned at all, as the
    expert stage does (``expert_search.search_experts``). ``notes``: a list the programs
    left unsolved are said in (``plan.solver.skipped``)."""
    seq = long_attention(cap)
    if seq is None or spec.mesh_shape is not None:
        return []
    batch = int(cap.node(cap.inputs[0]).meta["val"].shape[0])
    out, pruned = [], []
    for c, t in context_candidates(spec.options, spec.world, batch,
                                   spec.cluster.devices_per_node or spec.world, seq):
        pins = spec.options.replace(context=c, tensor=t if t > 1 else None)
        try:
            bal = balanced_copy(cap, c)
            if best_s is not None and mesh_floor(bal, spec.cluster, spec.world, pins,
                                                 spec.optimizer) >= best_s:
                if spec.verbose:
                    print(f"context={c} tensor={t}: cannot beat {best_s:.4g} s (compute floor)")
                continue
            got = plan_with(bal, pins, best_s if best_s is not None else math.inf, pruned)
        except (InfeasibleError, PinError):      # flat.BeyondCutoff among them
            continue
        out.append((got, bal))
        if best_s is None or got.estimate.step_time_s < best_s:
            best_s = got.estimate.step_time_s
    if pruned and notes is not None:
        notes.append(f"context: {len(pruned)} sharding programs not solved (mesh "
                     f"{', '.join(sorted({str(u.shape) for u in pruned}))}): their compute floor "
                     "or LP relaxation gives no step below the best plan found (exact); the "
                     "fewest-layers probes and activation offload of those programs not tried")
    return out


__all__ = ["LONG_SEQUENCE", "context_candidates", "long_attention", "search_context"]
