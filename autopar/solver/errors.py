"""Typed planning errors, so callers tell "does not fit" from other failures by type."""
from __future__ import annotations

from autopar.plan import PlanError
from autopar.solver.ilp import InfeasibleError, TimeLimitError, _gib
from autopar.pricing.problem import PinError
from autopar.solver.stage_dp import StagesDoNotFit

__all__ = ["InfeasibleError", "PipelineInfeasibleError", "PinError", "PlanError",
           "StageCutError", "StagesDoNotFit", "TimeLimitError"]


class PipelineInfeasibleError(InfeasibleError):
    """No cut of the pipeline (at its degree, micro-batches and schedule) fits the memory
    budget."""


class StageCutError(PlanError):
    """The stage DP found no cut of the graph for a reason other than memory (e.g. more
    stages than cut points)."""


TERMS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
         "activations": "activations", "recompute": "recomputed layers' activations",
         "offload": "offloaded layers' activations in flight",
         "loss_grads": "the loss's gradients",
         "inputs": "inputs"}
"""The cost model's memory terms, as the infeasibility message names them."""


def gib(b: float) -> str:
    return _gib(b)


def one_screen(budget: float, world: int, closest: list[dict], suggestions: list[dict],
               n_meshes: int, notes: tuple = ()) -> str:
    """The message of an infeasible search: the closest plan per mesh family (its memory
    per device by term, the binding term), then the smallest changes that fit, then
    ``notes`` (e.g. parameters a ZeRO stage leaves whole: ``solver.zero_whole``)."""
    lines = [f"no plan fits the memory budget of {_gib(budget)} per device on {world} devices "
             f"({n_meshes} meshes tried; every mesh's figures: error.meshes, or verbose=True).",
             "closest plan per mesh family (least memory per device):"]
    for r in closest:
        top = sorted(r["terms"].items(), key=lambda kv: -kv[1])[:3]
        terms = ", ".join(f"{TERMS.get(k, k)} {gib(b)}" for k, b in top)
        lines.append(f"  {r['family']}, mesh {r['mesh']}{', ' + r['variant'] if r['variant'] else ''}: "
                     f"needs {gib(r['need'])}, binding: {TERMS.get(r['binding'], r['binding'])}")
        lines.append(f"      largest: {terms}")
    lines.append("smallest change that fits:" if suggestions else
                 "no single change found that fits: pin a pipeline (pipeline=p) or use more devices")
    for s in suggestions:
        lines.append(f"  {s['change']}: {s['why']}")
    lines.extend(f"note: {n}" for n in notes)
    return "\n".join(lines)
