"""A plan's predicted step broken into the terms that make it up, and what separates two
plans' steps (``plan_quality.py`` prints it for every predicted gain over a published or
pinned configuration).

The terms are read from the prices the solver planned with: the plan's intra-stage
sharding problem and cost model are rebuilt as the solver built them (mesh without the
pipeline axis, the stage's sub-cluster, precision and ZeRO pins, recomputed layers,
gradient-sync scale), each decision takes the option whose placements the plan records,
and ``solver.pipeline_costs.node_costs`` prices every chain node under that choice (what
the stage DP and the pipeline estimate read). Seconds on the critical rank of one step:

- ``compute``: forward + backward of every op, recomputation excluded;
- ``recompute``: the forward that recomputed layers run again in backward;
- ``tensor-parallel comm``: collectives on the ``tensor`` axis (and on an unnamed axis,
  per op data or tensor, of an unpipelined free plan), once per micro-batch;
- ``data-parallel comm``: collectives on the ``data`` axis per micro-batch (ZeRO-3's
  gathers and reduce-scatters);
- ``grad sync (exposed)``: the once-per-step gradient reduction (and ZeRO-1/2's gathers)
  less what the estimate hides behind backward (its ``overlapped`` row; what that row
  hides beyond the reduction, ZeRO-3's collectives, comes off ``data-parallel comm``);
- ``pipeline p2p``: the estimate's sends between stages;
- ``pipeline bubble``: what is left of the step: the schedule's idle time on the
  critical rank and the runtime's cost per scheduled action (0 without a pipeline);
- ``optimizer step`` and ``host``: what the solver does not price and
  ``published_runs.predict`` adds: memory-bound over the parameters a GPU holds
  (``cost_models.step.optimizer_step_time``), and a per-step constant.

On a pipeline the critical rank is the one whose micro-batches take longest
(``m x (compute + comm)`` of its stages, plus its gradient reduction).
"""
from __future__ import annotations

import numpy as np

from autopar.analysis.layers import recompute_nodes
from autopar.cost_models.step import HOST_OVERHEAD_S, optimizer_step_time
from autopar.mesh_roles import MeshRoles
from autopar.placement import placements_str
from autopar.sharding.registry import input_placements, output_placements
from autopar.pricing.costing import OVERLAPPED, CostModel, StepView
from autopar.solver.flat import Solved
from autopar.options import OPTIMIZER_STATES
from autopar.solver.pipeline_costs import chain_index, node_costs
from autopar.solver.pipeline_search import _sub_cluster
from autopar.pricing.problem import build_problem

TERMS = ("compute", "recompute", "tensor-parallel comm", "data-parallel comm",
         "grad sync (exposed)", "pipeline p2p", "pipeline bubble", "optimizer step", "host")

WHY = {
    "compute": "less compute on the critical rank (a finer split of the work, or a cheaper "
               "sharding of its ops)",
    "recompute": "no (or less) activation recomputation: the memory it saved is not needed "
                 "under this plan's sharding",
    "tensor-parallel comm": "fewer or smaller tensor-parallel collectives (a smaller tensor "
                            "degree, or sharded so fewer activations cross)",
    "data-parallel comm": "fewer ZeRO gathers and reduce-scatters per micro-batch",
    "grad sync (exposed)": "a cheaper once-per-step gradient reduction (fewer parameters per "
                           "rank, or a group on faster links)",
    "pipeline p2p": "fewer or smaller sends between pipeline stages",
    "pipeline bubble": "a smaller pipeline bubble (fewer stages, more micro-batches per stage, "
                       "or a schedule that fills it)",
    "optimizer step": "fewer parameters per GPU to step",
    "host": "host overhead",
}


def _solved(cap, plan, cl, optimizer: str) -> Solved:
    """The solver's view of ``plan``'s intra-stage sharding on ``cap`` (its micro-batch graph)."""
    p = plan.pipeline_stages
    k0 = 1 if p > 1 else 0
    shape, axes = tuple(plan.mesh_shape[k0:]), tuple(plan.mesh_axes[k0:])
    roles = MeshRoles(**{a: axes.index(a) for a in ("data", "tensor") if a in axes})
    sub = _sub_cluster(cl, plan.world_size // p) if p > 1 else cl
    problem = build_problem(cap, shape, roles, zero=plan.pins.get("zero") or 0,
                            optimizer_states=OPTIMIZER_STATES[optimizer])
    cost = CostModel.for_pins(sub, shape, plan.options, data_axis=roles.data,
                              recompute=recompute_nodes(cap.gm, plan.recompute),
                              view=StepView(grad_sync_scale=1.0 / (plan.n_microbatches if p > 1
                                                                   else plan.accumulate)),
                              native=cap.native_dtypes)
    choice = {}
    for name, v in problem.vars.items():
        want = plan.nodes[name]
        ins = tuple(s[k0:] for s in want.inputs)
        outs = tuple(s[k0:] for s in want.outputs)
        n_in = len(v.call.inputs) if v.call else 0
        for i, combo in enumerate(v.options):
            if (tuple(placements_str(input_placements(combo, k)) for k in range(n_in)) == ins and
                    tuple(placements_str(output_placements(combo, k)) for k in range(len(v.outputs))) == outs):
                choice[name] = i
                break
        else:
            raise ValueError(f"node {name}: the plan's placements {want} are no option of the rebuilt problem")
    return Solved(problem, cost, choice)


def _axis_class(key: str) -> str:
    axis = key.split("@", 1)[1]
    return {"data": "data-parallel comm", "pipeline": "pipeline p2p"}.get(axis, "tensor-parallel comm")


def step_terms(cap, plan, cl, optimizer: str = "adamw") -> dict[str, float]:
    """Seconds by term (``TERMS``) of ``plan``'s step on ``cl``; they add up to the step
    plus the optimizer step and the host constant."""
    k0 = 1 if plan.pipeline_stages > 1 else 0
    nc = node_costs(cap, _solved(cap, plan, cl, optimizer), lambda n: 0.0, axes=plan.mesh_axes[k0:])
    units = nc.units
    # what node_costs adds for a recomputed node: its forward again
    rec = np.zeros(len(units))
    where = chain_index(cap, units)
    for name in recompute_nodes(cap.gm, plan.recompute)[0]:
        if name in where:
            rec[where[name]] += nc.node_forward.get(name, 0.0)
    p, m = plan.pipeline_stages, max(plan.n_microbatches if plan.pipeline_stages > 1 else plan.accumulate, 1)
    if p > 1:
        cuts = [units.index(c) for c in plan.pipeline.stage_cuts]
        bounds = (0, *cuts, len(units))
        stages = list(zip(bounds[:-1], bounds[1:]))
        ranks = [[stages[k] for k in range(r, len(stages), p)] for r in range(p)]
    else:
        ranks = [[(0, len(units))]]

    def load(spans):
        return sum(m * float((nc.compute[j:i] + nc.comm[j:i]).sum()) + float(nc.sync[j:i].sum())
                   for j, i in spans)
    spans = max(ranks, key=load)
    out = dict.fromkeys(TERMS, 0.0)
    for j, i in spans:
        out["recompute"] += m * float(rec[j:i].sum())
        out["compute"] += m * float(nc.compute[j:i].sum() - rec[j:i].sum())
        for by, times in ((nc.comm_by, m), (nc.sync_by, 1)):
            for d in by[j:i]:
                for key, s in d.items():
                    out["grad sync (exposed)" if by is nc.sync_by else _axis_class(key)] += times * s
    out["pipeline p2p"] = float(plan.estimate.comm.get("send_recv@pipeline", 0.0))
    # what the estimate hides behind compute (its negative "overlapped" row): the gradient
    # reduction first, the rest of ZeRO-3's per-micro-batch collectives after
    hidden = -float(plan.estimate.comm.get(OVERLAPPED, 0.0))
    from_sync = min(hidden, out["grad sync (exposed)"])
    out["grad sync (exposed)"] -= from_sync
    out["data-parallel comm"] -= hidden - from_sync
    solver_terms = sum(v for k, v in out.items() if k not in ("pipeline bubble",))
    out["pipeline bubble"] = plan.estimate.step_time_s - solver_terms if p > 1 else 0.0
    out["optimizer step"] = optimizer_step_time(local_params(plan, optimizer), cl.device,
                                                mixed=plan.pins.get("precision") in ("bf16", "fp16"))
    out["host"] = HOST_OVERHEAD_S
    return out


def local_params(plan, optimizer: str = "adamw") -> float:
    """Parameters the fullest GPU steps: its optimizer bytes over the bytes per parameter
    (fp32 moments, and an fp32 master copy in mixed precision)."""
    k = OPTIMIZER_STATES[optimizer]
    per = 4 * (1 + k) if plan.pins.get("precision") in ("bf16", "fp16") else 4 * k
    return plan.estimate.memory_bytes.get("optimizer", 0.0) / max(per, 1)


def full_step(terms: dict[str, float]) -> float:
    return sum(terms.values())


def gain_table(base: dict[str, float], free: dict[str, float], base_label: str = "published",
               indent: str = "    ") -> list[str]:
    """Lines: each term of both plans and the seconds it saves (largest first), the total,
    and a one-line reason for the largest saving."""
    saved = {k: base[k] - free[k] for k in TERMS}
    lines = [f"{indent}{'term':<22}{base_label + ' s':>12}{'free s':>10}{'saved s':>10}"]
    for k in sorted(TERMS, key=lambda k: -abs(saved[k])):
        if base[k] == 0 and free[k] == 0:
            continue
        lines.append(f"{indent}{k:<22}{base[k]:>12.3f}{free[k]:>10.3f}{saved[k]:>+10.3f}")
    lines.append(f"{indent}{'step':<22}{full_step(base):>12.3f}{full_step(free):>10.3f}"
                 f"{full_step(base) - full_step(free):>+10.3f}")
    top = max(TERMS, key=lambda k: saved[k])
    lines.append(f"{indent}largest: {top} ({saved[top]:+.3f} s): {WHY[top]}")
    return lines
