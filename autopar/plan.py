"""The Plan: every decision autopar made, as plain data that round-trips through JSON.

A plan names each graph node's placements (per tensor input and output, one entry per mesh
axis, written ``S(0)R`` for Shard(0) on axis 0 and Replicate on axis 1), the mesh, the
pins it honoured, what the solver reported, and the cost model's estimate. It is the only
thing that crosses from deciding (capture, cost, solve) to doing (passes, runtime).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autopar.placement import parse_placements

PLAN_VERSION = 1


class PlanError(ValueError):
    """A plan file or plan object is malformed or does not fit the model / world."""


@dataclass(frozen=True)
class NodePlacement:
    """Placements of one node: ``inputs[k]`` for its k-th tensor input, ``outputs[k]`` for its
    k-th tensor output; each a string with one placement per mesh axis (``"S(0)R"``)."""
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def input(self, k: int):
        return parse_placements(self.inputs[k])

    def output(self, k: int):
        return parse_placements(self.outputs[k])

    def __str__(self) -> str:
        return f"{','.join(self.inputs)}->{','.join(self.outputs)}" if self.inputs else ",".join(self.outputs)


@dataclass(frozen=True)
class Estimate:
    """What the cost model predicts for one training step on one device."""
    step_time_s: float
    compute_s: float
    comm_s: float
    memory_bytes: dict[str, float]            # by term: params, grads, optimizer, activations...
    comm: dict[str, float]                    # "all_reduce@axis0" -> seconds
    bubble_fraction: float = 0.0
    stage_times_s: tuple[float, ...] = ()
    """Pipeline plans: each stage's forward + backward seconds for one micro-batch, the
    runtime's cost per action included (what the schedule simulator was given)."""

    def __post_init__(self):
        object.__setattr__(self, "stage_times_s", tuple(float(t) for t in self.stage_times_s))

    @property
    def memory_total(self) -> float:
        return float(sum(self.memory_bytes.values()))


@dataclass(frozen=True)
class SolverReport:
    status: str
    objective_s: float
    bound_s: float
    gap: float
    solve_time_s: float
    capture_time_s: float
    n_variables: int
    n_constraints: int
    n_graph_nodes: int
    n_decisions: int                          # after sharing repeated layers


@dataclass(frozen=True)
class Plan:
    world_size: int
    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    cluster: str
    pins: dict[str, Any]
    nodes: dict[str, NodePlacement]
    params: dict[str, str]                    # parameter name -> graph placeholder
    fingerprint: str                          # of the graph the plan was made for
    estimate: Estimate
    solver: SolverReport
    memory_budget: float | None = None
    param_shapes: dict[str, list[int]] = field(default_factory=dict)
    node_ops: dict[str, str] = field(default_factory=dict)      # node -> ATen op
    inputs: tuple[str, ...] = ()                                 # user inputs, then the target
    recompute: tuple[str, ...] = ()          # layers run again in backward ("transformer.h.0")
    version: int = PLAN_VERSION
    # ---- pipeline (autopar.pipeline). When pipeline_stages > 1, mesh axis 0 is "pipeline"
    # and ``nodes`` holds placements on the intra-stage axes (mesh_shape[1:]) only, for the
    # graph captured with micro-batch inputs ----
    pipeline_stages: int = 1                  # pipeline ranks p
    virtual_stages: int = 1                   # stages per rank v
    n_microbatches: int = 1
    schedule: str = ""                        # "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"
    stage_cuts: tuple[str, ...] = ()          # first graph node of stages 1 .. p*v-1

    # ---- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["mesh_shape"] = list(self.mesh_shape)
        d["mesh_axes"] = list(self.mesh_axes)
        d["nodes"] = {k: {"inputs": list(v.inputs), "outputs": list(v.outputs)}
                      for k, v in self.nodes.items()}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        from autopar.plan_schema import check
        check(d)          # names the field, the value and what was expected
        try:
            version = d.get("version")
            if version != PLAN_VERSION:
                raise PlanError(f"plan version {version!r} is not supported (expected {PLAN_VERSION})")
            nodes = {}
            for k, v in d["nodes"].items():
                for s in list(v["inputs"]) + list(v["outputs"]):
                    parse_placements(s)        # validates
                nodes[k] = NodePlacement(tuple(v["inputs"]), tuple(v["outputs"]))
            return cls(
                world_size=int(d["world_size"]), mesh_shape=tuple(int(n) for n in d["mesh_shape"]),
                mesh_axes=tuple(d["mesh_axes"]), cluster=str(d["cluster"]), pins=dict(d["pins"]),
                nodes=nodes, params=dict(d["params"]), fingerprint=str(d["fingerprint"]),
                estimate=Estimate(**d["estimate"]), solver=SolverReport(**d["solver"]),
                memory_budget=d.get("memory_budget"),
                param_shapes={k: list(v) for k, v in d.get("param_shapes", {}).items()},
                node_ops=dict(d.get("node_ops", {})), inputs=tuple(d.get("inputs", ())),
                recompute=tuple(d.get("recompute", ())),
                version=version, pipeline_stages=int(d.get("pipeline_stages", 1)),
                virtual_stages=int(d.get("virtual_stages", 1)),
                n_microbatches=int(d.get("n_microbatches", 1)), schedule=str(d.get("schedule", "")),
                stage_cuts=tuple(d.get("stage_cuts", ())))
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"malformed plan: {type(e).__name__}: {e}") from e

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        try:
            d = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise PlanError(f"{path}: not JSON ({e})") from e
        return cls.from_dict(d)

    # ---- reading ------------------------------------------------------------------------
    def summary(self) -> str:
        from autopar.report import plan_summary
        return plan_summary(self)

    def __repr__(self) -> str:
        return (f"Plan(mesh={self.mesh_shape} {self.mesh_axes}, world={self.world_size}, "
                f"step≈{self.estimate.step_time_s * 1e3:.3f} ms, nodes={len(self.nodes)})")
