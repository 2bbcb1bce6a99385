"""Pipeline planner: stage cuts (``stage_dp``), schedules as data (``schedule``) and a
per-rank timeline simulator (``simulate``). Pure: no processes; torch is imported only by
``torch_schedule_class``."""
from autopar.pipeline.schedule import (SCHEDULES, Action, check_schedule, format_grid,
                                       schedule_actions, torch_schedule_class)
from autopar.pipeline.simulate import Simulation, simulate
from autopar.pipeline.stage_dp import LayerCosts, StagePlan, plan_stages, simulate_plan, stage_dp

__all__ = ["SCHEDULES", "Action", "LayerCosts", "Simulation", "StagePlan", "check_schedule",
           "format_grid", "plan_stages", "schedule_actions", "simulate", "simulate_plan",
           "stage_dp", "torch_schedule_class"]
