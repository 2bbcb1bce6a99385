"""Expert axes in the free search: the expert-parallel degrees (``expert=e``) weighed with
data, tensor and pipeline degrees, for graphs whose mixture-of-experts layers are
``autopar::moe_experts`` ops (``autopar.capture.experts``).

Where: a graph with at least one experts op, and no pin that excludes an expert axis
(``expert=`` pinned already, ``expert_dispatch="tensor"``, or what ``Options`` refuses
beside ``expert=``: ZeRO, branches, context, lossy reduction, local SGD, offload).

What: each degree ``e >= 2`` dividing the experts of every MoE layer and the devices left
by the tensor degree (an expert axis splits each layer's weight stacks ``e`` ways and the
batch over its ranks, as DeepSeek's EP and torchtitan's dp2ep run). Unpipelined
(:func:`search_experts`), with the tensor degrees a node's devices allow, planned as if
pinned; in the pipeline search, a stage's meshes (``pipeline_free._DegreeSearch``).

Bounds, each a true lower bound of what a plan on the mesh would need, so pruning by them
never drops the plan the unpruned search finds (``tests/test_experts_search.py``):

* memory (:func:`least_state_bytes`): a rank holds at least its share of the parameters,
  gradients and optimizer state: the experts' stacks split at most ``e * t`` ways (the
  expert and tensor axes), every other parameter at most ``t`` ways (ZeRO is not combined
  with an expert axis, so the data and expert axes replicate them), each over ``p``
  pipeline stages at best;
* compute (``prices.compute_floor``): the sum of every node's least compute on the mesh,
  which no plan's predicted step falls below; a mesh whose floor is at least the best step
  found is not solved.
"""
from __future__ import annotations

import math

from autopar.capture.experts import expert_stacks
from autopar.errors import PinError
from autopar.ops.experts import EXPERTS_OP
from autopar.options import Options
from autopar.solver.errors import InfeasibleError
from autopar.solver.flat import mesh_floor
from autopar.solver.pipeline_price import state_per_param


def moe_experts(cap) -> int | None:
    """The fewest experts of any of ``cap``'s experts ops (the dim 0 of its weight stacks),
    None when the graph has none."""
    counts = []
    for n in cap.gm.graph.nodes:
        if n.op == "call_function" and n.target is EXPERTS_OP:
            stacks = n.args[3]
            if stacks:
                counts.append(int(stacks[0].meta["val"].shape[0]))
    return min(counts) if counts else None


def expert_free(pins: Options) -> bool:
    """Whether ``pins`` leave an expert axis to the search (module docstring)."""
    if (pins.expert or 1) > 1 or pins.expert == 1 or pins.expert_dispatch == "tensor":
        return False
    return ((pins.context or 1) == 1 and (pins.branch or 1) == 1 and not pins.zero
            and pins.compress in (None, "none") and not pins.local_sgd and pins.offload is None)


def expert_degrees(n_experts: int, devices: int) -> list[int]:
    """Expert degrees ``e >= 2`` dividing both the experts and the ``devices`` left for the
    data and expert axes, least first."""
    g = math.gcd(n_experts, devices)
    return [e for e in range(2, g + 1) if g % e == 0]


def split_state_bytes(cap, per_param: float) -> tuple[float, float]:
    """(bytes of the non-expert parameters' state, bytes of the experts' stacks' state),
    ``per_param`` bytes of state per parameter element (``pipeline_price.state_bytes``)."""
    stacks = expert_stacks(cap.gm)
    dense = experts = 0
    for ph in cap.params:
        n = cap.node(ph).meta["val"].numel()
        if ph in stacks:
            experts += n
        else:
            dense += n
    return dense * per_param, experts * per_param


def least_state_bytes(dense: float, experts: float, p: int, tensor: int, expert: int) -> float:
    """Parameter and optimizer bytes the fullest rank of a ``p``-stage pipeline (1: none)
    on a stage mesh with ``tensor`` and ``expert`` axes holds at least (module docstring)."""
    return (dense / tensor + experts / (tensor * expert)) / p


def flat_candidates(pins: Options, world: int, batch: int, devices_per_node: int,
                    n_experts: int) -> list[tuple[int, int]]:
    """(expert, tensor) degrees the unpipelined expert stage plans: tensor parallelism t
    dividing a node's devices (the ``tensor=`` pin, if any), the expert degrees of what is
    left, with a batch the data x expert ranks split evenly (``data=`` as pinned)."""
    if not expert_free(pins):
        return []
    ts = [pins.tensor] if pins.tensor else \
        [t for t in range(1, devices_per_node + 1) if devices_per_node % t == 0]
    out = []
    for t in ts:
        if world % t:
            continue
        for e in expert_degrees(n_experts, world // t):
            d = world // (t * e)
            if (pins.data is None or pins.data == d) and batch % (d * e) == 0:
                out.append((e, t))
    return out


def search_experts(spec, cap, plan_with, best_s: float | None, notes: list | None = None):
    """The unpipelined expert plans of :func:`flat_candidates` that fit: [Plan], each
    mesh pruned first by the memory bound, then by its compute floor against the best step
    found (``best_s``, or the best of these so far), then each of its programs (without
    and with recomputation) by the same: ``plan_with(graph, pins, cutoff_s, pruned)``, the
    unpipelined plan of a graph under pins (the free search's, ``flat.solve_ask``), leaves
    a program whose compute floor or LP relaxation is at least ``cutoff_s`` unsolved
    (``MeshAsk.cutoff_s``: exact, no plan on it beats the best found) and adds it to
    ``pruned``. Mixtral 8x7B on 64 H100: without recomputation nothing fits an expert
    mesh, and with every layer recomputed the compute floors are 2.78-2.80 s, above the
    best pipeline's 2.57 s: 6 programs left unsolved, the stage 12 s (835 s before, its
    fewest-layers probes 468 s of it, in a profile under load 14). ``notes``: a list the
    programs left unsolved are said in (``plan.solver.skipped``)."""
    n = moe_experts(cap)
    if n is None or spec.mesh_shape is not None:
        return []
    batch = int(cap.node(cap.inputs[0]).meta["val"].shape[0])
    dense, experts = split_state_bytes(cap, state_per_param(spec.optimizer, spec.options.precision))
    budget = spec.budget
    out, pruned = [], []
    for e, t in flat_candidates(spec.options, spec.world, batch,
                                spec.cluster.devices_per_node or spec.world, n):
        if least_state_bytes(dense, experts, 1, t, e) > budget:
            if spec.verbose:
                print(f"experts e={e} tensor={t}: parameters and optimizer state alone exceed "
                      "the memory budget")
            continue
        pins = spec.options.replace(expert=e, tensor=t if t > 1 else None)
        try:
            if best_s is not None and mesh_floor(cap, spec.cluster, spec.world, pins,
                                                 spec.optimizer) >= best_s:
                if spec.verbose:
                    print(f"experts e={e} tensor={t}: cannot beat {best_s:.4g} s (compute floor)")
                continue
            got = plan_with(cap, pins, best_s if best_s is not None else math.inf, pruned)
        except (InfeasibleError, PinError):    # flat.BeyondCutoff among them
            continue
        out.append(got)
        if best_s is None or got.estimate.step_time_s < best_s:
            best_s = got.estimate.step_time_s
    if pruned and notes is not None:
        meshes = sorted({str(u.shape) for u in pruned})
        notes.append(f"experts: {len(pruned)} sharding programs not solved (mesh "
                     f"{', '.join(meshes)}): their compute floor or LP relaxation gives no step "
                     "below the best plan found (exact); the fewest-layers probes and "
                     "activation offload of those programs not tried")
    return out


__all__ = ["expert_degrees", "expert_free", "flat_candidates", "least_state_bytes",
           "moe_experts", "search_experts", "split_state_bytes"]
