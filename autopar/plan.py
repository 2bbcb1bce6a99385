"""The Plan: every decision autopar made, as plain data that round-trips through JSON.

A plan names each graph node's placements (per tensor input and output, one entry per mesh
axis, written ``S(0)R`` for Shard(0) on axis 0 and Replicate on axis 1), the mesh, the
pins it honoured, what the solver reported, and the cost model's estimate. It is the only
thing that crosses from deciding (capture, cost, solve) to doing (passes, runtime).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autopar.cost_models.memory import peak_bytes
from autopar.options import Options
from autopar.placement import parse_placements
from autopar.plan_schema import PlanError, check
from autopar.report import plan_summary

PLAN_VERSION = 3
"""2: the pipeline is one optional part (``Plan.pipeline``) of the one plan. Version 1
files (the pipeline's fields at the top level) are read and converted on load. The
optional ``accumulate`` field (gradient accumulation) reads as 1 where a file lacks it, and
the optional ``branches`` (branch parallelism) as none, and the optional ``offload``
(ZeRO-Offload), ``host_memory_bytes``, ``disk_bytes`` and ``alternatives_s`` as none."""

__all__ = ["PLAN_VERSION", "BranchGroups", "Estimate", "NodePlacement", "Pipeline", "Plan", "PlanError",
           "SolverReport"]


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
    memory_phases: tuple[tuple[str, ...], ...] = ()
    """Groups of ``memory_bytes`` terms never live at once (an unpipelined step: the loss's
    backward, a layer's backward, the end of backward's gradients;
    ``cost_models.memory.step_phases``).
    Empty: every term at once (pipelines, gradient accumulation, plan files from before)."""
    host_s: float = 0.0
    """Host seconds of the step's eager dispatches (``cost_models.host``), overlapped with
    the device side: ``step_time_s = max(compute + comm, host_s)``
    (``cost_models.step.step_time``). 0: not priced (CPU ranks, pipelines, older files)."""

    rank_memory_bytes: tuple[dict[str, float], ...] = ()
    """Pipeline plans: per pipeline rank, its bytes per device by term (``memory_bytes`` is
    the fullest rank's). Empty: one rank's memory is every rank's (no pipeline), or a plan
    file from before."""

    def __post_init__(self):
        object.__setattr__(self, "stage_times_s", tuple(float(t) for t in self.stage_times_s))
        object.__setattr__(self, "rank_memory_bytes", tuple({str(k): float(b) for k, b in r.items()}
                                                            for r in self.rank_memory_bytes))
        object.__setattr__(self, "memory_phases", tuple(tuple(str(k) for k in g) for g in self.memory_phases))

    @property
    def memory_total(self) -> float:
        """Peak bytes per device: the terms in no phase plus the largest phase
        (``cost_models.memory.peak_bytes``); the sum of the terms when there are no phases."""
        return peak_bytes(self.memory_bytes, self.memory_phases)


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
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per planning phase (capture, each mesh's ILP, ZeRO stages, accumulation,
    pipeline search, total), as the search measured them."""
    time_limit: str = ""
    """"" when every sharding ILP of the search finished (``status`` "OPTIMAL"); else what
    the time limit (``time_limit_s``) stopped: the chosen program's search, ended with its
    incumbent (``status`` "FEASIBLE", ``gap`` to its bound), and the programs skipped for
    having no solution by then. Such a plan depends on how far the search got, so on the
    machine's load; raise ``time_limit_s`` for the one a finished search gives."""
    skipped: str = ""
    """What the search did not try, by a stage's stated rule ("; " between stages: the
    gradient accumulation's programs left unsolved for their bound,
    ``accumulate.pruned_note``); "" when it tried everything its stages weigh."""
    capture_cache: str = ""
    """Whether the captured graphs came from the capture cache (``autopar.capture.cache``):
    "hit" (all of them), "miss" (none; stored for the next planning), "k of n from the
    cache", "off" (``cache=False`` / ``AUTOPAR_CACHE=0``), "" (not recorded)."""


@dataclass(frozen=True)
class Pipeline:
    """The pipeline part of a plan: the mesh's leading ``"pipeline"`` axis has ``stages``
    ranks; each runs ``virtual_stages`` stages (``k``, ``k + stages``, ...) of the graph cut
    before the nodes ``stage_cuts``, under ``schedule`` with ``n_microbatches`` equal
    micro-batches. The graph is captured at micro-batch size; each node's placements (its
    stage's) cover every mesh axis, ``R`` on the pipeline axis."""
    stages: int
    virtual_stages: int = 1
    n_microbatches: int = 1
    schedule: str = "1f1b"        # "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "dualpipev"
    stage_cuts: tuple[str, ...] = ()          # first graph node of stages 1 .. p*v-1

    def __post_init__(self):
        object.__setattr__(self, "stage_cuts", tuple(self.stage_cuts))


@dataclass(frozen=True)
class BranchGroups:
    """Branch parallelism over one set of independent branches (``analysis.branches``):
    the ranks at coordinate ``g`` of the mesh axis ``"branch"`` run (and store the
    parameters of) the graph nodes ``groups[g]``; every other node runs on every rank. The
    fork's value reaches every group (its gradient is summed over the axis); each group
    feeds the ``join`` its own branches' results and zeros for the others', and the join's
    result is summed over the axis, so every rank holds all of it."""
    fork: str
    join: str
    groups: tuple[tuple[str, ...], ...]

    def __post_init__(self):
        object.__setattr__(self, "groups", tuple(tuple(g) for g in self.groups))

    def owner(self) -> dict[str, int]:
        """Graph node -> the branch-axis coordinate that runs it."""
        return {n: g for g, nodes in enumerate(self.groups) for n in nodes}


@dataclass(frozen=True)
class Plan:
    world_size: int
    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    cluster: str
    options: Options
    """The options the plan runs with: the user's pins and what the search chose (the ZeRO
    stage, a compression scheme, ...). The runtime reads these, never the solver."""
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
    pipeline: Pipeline | None = None         # None: one stage, no pipeline axis
    accumulate: int = 1
    """Without a pipeline: micro-batches per step (gradient accumulation). The graph is
    captured at micro-batch size; each micro-batch runs forward and backward, gradients
    are synchronised once per step. 1 under a pipeline (``pipeline.n_microbatches``)."""
    branches: tuple[BranchGroups, ...] = ()
    """Branch parallelism (the mesh axis ``"branch"``): each set of independent branches
    and which coordinate of that axis runs which branch. Empty: none."""
    offload: str | None = None
    """ZeRO-Offload: ``"optimizer"`` keeps each rank's optimizer shard (fp32 master copy and
    moments) on the host and steps it there (``autopar.runtime.offload``); None: on the
    device. ``estimate.memory_bytes`` is device memory; the host's is ``host_memory_bytes``."""
    host_memory_bytes: dict[str, float] = field(default_factory=dict)
    """Host bytes per rank by term under ``offload`` (``"optimizer"``: master copy and
    moments, ``"grads"``: the gradient shard copied down); empty without offload. Under
    ``offload="disk"`` the optimizer term is on disk (``disk_bytes``), not here."""
    disk_bytes: dict[str, float] = field(default_factory=dict)
    """Disk bytes per rank by term under ``offload="disk"`` (``"optimizer"``: the master copy
    and moments, in files between steps, ``autopar.runtime.disk_offload``); empty otherwise."""
    alternatives_s: dict[str, float] = field(default_factory=dict)
    """The predicted step of the best plan of each kind the search weighed against this one
    and did not take (``"without a context axis"``: what context parallelism buys); empty
    when none was weighed."""
    version: int = PLAN_VERSION

    def __post_init__(self):
        if not isinstance(self.options, Options):
            object.__setattr__(self, "options", Options.from_pins(self.options))

    @property
    def pins(self) -> dict[str, Any]:
        """The options that are set, as a dict (``options.pinned()``): the form of plans
        before version 3."""
        return self.options.pinned()

    # ---- the pipeline part, read flat (one stage when there is none) --------------------
    @property
    def pipeline_stages(self) -> int:
        return self.pipeline.stages if self.pipeline else 1

    @property
    def virtual_stages(self) -> int:
        return self.pipeline.virtual_stages if self.pipeline else 1

    @property
    def n_microbatches(self) -> int:
        """Micro-batches per step: the pipeline's, else the accumulation's (1: none)."""
        return self.pipeline.n_microbatches if self.pipeline else self.accumulate

    @property
    def schedule(self) -> str:
        return self.pipeline.schedule if self.pipeline else ""

    @property
    def stage_cuts(self) -> tuple[str, ...]:
        return self.pipeline.stage_cuts if self.pipeline else ()

    @property
    def stage_mesh_shape(self) -> tuple[int, ...]:
        """The mesh one stage runs on (the whole mesh without a pipeline)."""
        return tuple(self.mesh_shape[1:]) if self.pipeline else tuple(self.mesh_shape)

    # ---- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The plan as JSON data (lists, not tuples), as ``to_json`` writes it; its options
        as the mapping of those that are set."""
        return json.loads(json.dumps(self._fields()))

    def to_json(self) -> str:
        return json.dumps(self._fields(), indent=1)

    def digest(self) -> str:
        """A hash of everything the plan chose (placements, mesh, stage cuts, options,
        estimate), not of the solver's report (its timings) or the file's version: equal
        digests, the same plan."""
        chosen = {k: v for k, v in self.to_dict().items() if k not in ("solver", "version")}
        chosen["estimate"].pop("host_s", None)   # a figure, not a choice: the step holds it where it binds
        return hashlib.sha256(json.dumps(chosen, sort_keys=True, default=str).encode()).hexdigest()[:12]

    def _fields(self) -> dict:
        d = asdict(self)
        if not d["estimate"].get("host_s"):     # unpriced: the file (and digest) as before it
            d["estimate"].pop("host_s", None)
        d["options"] = self.options.pinned()
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        d = upgrade(d)
        check(d)          # names the field, the value and what was expected
        try:
            nodes = {}
            for k, v in d["nodes"].items():
                for s in list(v["inputs"]) + list(v["outputs"]):
                    parse_placements(s)        # validates
                nodes[k] = NodePlacement(tuple(v["inputs"]), tuple(v["outputs"]))
            pipe = d.get("pipeline")
            if pipe and (d["mesh_axes"][:1] != ["pipeline"] or d["mesh_shape"][0] != pipe["stages"]):
                raise PlanError(f"plan field pipeline.stages: {pipe['stages']} pipeline stages need "
                                f"a leading mesh axis 'pipeline' of that size; the mesh is "
                                f"{d['mesh_shape']} {d['mesh_axes']}")
            accumulate = int(d.get("accumulate", 1))
            if pipe and accumulate != 1:
                raise PlanError(f"plan field accumulate: {accumulate} micro-batches of gradient "
                                "accumulation beside a pipeline part; a pipeline's micro-batches "
                                "are pipeline.n_microbatches (set accumulate to 1)")
            branches = _branches(d)
            return cls(
                world_size=int(d["world_size"]), mesh_shape=tuple(int(n) for n in d["mesh_shape"]),
                mesh_axes=tuple(d["mesh_axes"]), cluster=str(d["cluster"]),
                options=_options(d["options"]),
                nodes=nodes, params=dict(d["params"]), fingerprint=str(d["fingerprint"]),
                estimate=Estimate(**d["estimate"]), solver=SolverReport(**d["solver"]),
                memory_budget=d.get("memory_budget"),
                param_shapes={k: list(v) for k, v in d.get("param_shapes", {}).items()},
                node_ops=dict(d.get("node_ops", {})), inputs=tuple(d.get("inputs", ())),
                recompute=tuple(d.get("recompute", ())),
                pipeline=Pipeline(**pipe) if pipe else None, accumulate=accumulate,
                branches=branches, offload=_offload(d),
                host_memory_bytes={k: float(v) for k, v in (d.get("host_memory_bytes") or {}).items()},
                disk_bytes={k: float(v) for k, v in (d.get("disk_bytes") or {}).items()},
                alternatives_s={k: float(v) for k, v in (d.get("alternatives_s") or {}).items()},
                version=PLAN_VERSION)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, PlanError):
                raise
            raise PlanError(f"malformed plan: {type(e).__name__}: {e}") from e

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """The plan in the JSON file ``path``; a PlanError names what is wrong with it."""
        if not isinstance(path, (str, os.PathLike)):
            raise PlanError(f"Plan.load takes the path of a plan file, got {type(path).__name__}; "
                            "a Plan object is passed as it is (plan=the_plan)")
        file = Path(path)
        if not file.is_file():
            what = "is a directory, not a plan file" if file.is_dir() else "does not exist"
            raise PlanError(f"{str(path)!r} {what}: pass the file plan.save(path) or `autopar plan "
                            "... -o FILE` wrote")
        try:
            d = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise PlanError(f"{path}: not JSON ({e}); pass the file plan.save(path) wrote") from e
        except (UnicodeDecodeError, OSError) as e:
            raise PlanError(f"{path}: cannot read the plan ({type(e).__name__}: {e}); pass the file "
                            "plan.save(path) wrote") from e
        return cls.from_dict(d)

    # ---- reading ------------------------------------------------------------------------
    def summary(self) -> str:
        return plan_summary(self)

    def __repr__(self) -> str:
        return (f"Plan(mesh={self.mesh_shape} {self.mesh_axes}, world={self.world_size}, "
                f"step≈{self.estimate.step_time_s * 1e3:.3f} ms, nodes={len(self.nodes)})")


def _offload(d: dict) -> str | None:
    """The plan's ``offload`` (absent in older files: None)."""
    v = d.get("offload")
    if v not in (None, "optimizer", "disk"):
        raise PlanError(f"plan field offload: {v!r} is not an offload choice (expected "
                        "\"optimizer\", \"disk\" or null)")
    return v


def _branches(d: dict) -> tuple[BranchGroups, ...]:
    """The plan's branch sets, checked against its mesh (a PlanError naming the field)."""
    sets = d.get("branches") or []
    if not sets:
        return ()
    axes = list(d["mesh_axes"])
    if "branch" not in axes:
        raise PlanError(f"plan field branches: branch parallelism needs a mesh axis 'branch'; the "
                        f"mesh is {d['mesh_shape']} {axes} (add the axis, or empty branches)")
    if d.get("pipeline"):
        raise PlanError("plan field branches: branch parallelism beside a pipeline part is not "
                        "supported; plan without pipeline= or without branch=")
    size = d["mesh_shape"][axes.index("branch")]
    seen: dict[str, str] = {}
    out = []
    for i, b in enumerate(sets):
        if len(b["groups"]) != size:
            raise PlanError(f"plan field branches[{i}].groups: {len(b['groups'])} groups, but the "
                            f"mesh axis 'branch' has {size} ranks (one group per coordinate)")
        for g, nodes in enumerate(b["groups"]):
            if not nodes:
                raise PlanError(f"plan field branches[{i}].groups[{g}]: empty; every coordinate "
                                "of the 'branch' axis runs at least one branch")
            for n in nodes:
                if n in seen or n in (b["fork"], b["join"]):
                    raise PlanError(f"plan field branches[{i}].groups[{g}]: node {n!r} is "
                                    f"{'the fork or the join' if n not in seen else 'also in ' + seen[n]}"
                                    "; each branch node belongs to one group")
                seen[n] = f"branches[{i}].groups[{g}]"
        out.append(BranchGroups(str(b["fork"]), str(b["join"]), b["groups"]))
    return tuple(out)


def _options(given: dict) -> Options:
    try:
        return Options.from_pins(given)
    except ValueError as e:       # ArgumentError, PinError: the words of the catalogue
        raise PlanError(f"plan field options: {e}; make the plan again (autopar.plan or "
                        "`autopar plan`) or undo the edit") from e


_V1_PIPELINE = ("pipeline_stages", "virtual_stages", "n_microbatches", "schedule", "stage_cuts")


def upgrade(d: dict) -> dict:
    """A plan dict of an older version as the current version, or a PlanError naming the
    version and the fix. Version 1 kept the pipeline's fields at the top level; versions 1
    and 2 named the options "pins"."""
    if not isinstance(d, dict):
        raise PlanError(f"a plan is a JSON object, got {type(d).__name__}")
    version = d.get("version")
    if version == PLAN_VERSION:
        return d
    if version == 1:
        new = {k: v for k, v in d.items() if k not in _V1_PIPELINE}
        stages = int(d.get("pipeline_stages", 1) or 1)
        new["pipeline"] = None if stages <= 1 else {
            "stages": stages, "virtual_stages": int(d.get("virtual_stages", 1)),
            "n_microbatches": int(d.get("n_microbatches", 1)),
            "schedule": str(d.get("schedule", "")), "stage_cuts": list(d.get("stage_cuts", ()))}
        d, version = {**new, "version": 2}, 2
    if version == 2:       # version 3 names the options "options" (they were "pins")
        new = {k: v for k, v in d.items() if k != "pins"}
        new["options"] = d.get("pins", {})
        new["version"] = PLAN_VERSION
        return new
    raise PlanError(f"plan field version: {version!r} is not supported (this autopar reads "
                    f"versions 1 to {PLAN_VERSION}): plan again with this autopar "
                    "(autopar.plan or `autopar plan`)")
