"""Typed planning errors, so callers tell "does not fit" from other failures by type."""
from __future__ import annotations

from autopar.plan import PlanError
from autopar.solver.ilp import InfeasibleError
from autopar.solver.problem import PinError
from autopar.solver.stage_dp import StagesDoNotFit

__all__ = ["InfeasibleError", "PipelineInfeasibleError", "PinError", "PlanError",
           "StageCutError", "StagesDoNotFit"]


class PipelineInfeasibleError(InfeasibleError):
    """No cut of the pipeline (at its degree, micro-batches and schedule) fits the memory
    budget."""


class StageCutError(PlanError):
    """The stage DP found no cut of the graph for a reason other than memory (e.g. more
    stages than cut points)."""
