"""What one search is asked, as one value: :class:`SearchSpec`.

``autopar.plan``, ``autopar.parallelize`` and the CLI hand the driver a model, its example
batch, a loss, a cluster, options and limits; the driver makes them one frozen
``SearchSpec`` and every stage of the search (``driver``: unpipelined, branches,
pipelines, accumulation, offload, the probes of fewer recomputed layers) reads it, instead
of each stage taking a dozen loose arguments. A variant (another compression scheme under
``compress="auto"``) is ``spec.with_options(compress=...)``. What a search returns is :class:`Planned`.

:class:`Settings` is the part of a spec the searches below the driver pass on whole (the
memory budget, a mesh shape, the optimizer, the ILP's time limit, verbosity, the
profiler): ``spec.settings``, never taken apart into keywords again.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, NamedTuple

from torch import nn

from autopar.capture import Captured
from autopar.cost_models.hardware import Cluster
from autopar.options import Options
from autopar.plan import Plan


@dataclass(frozen=True)
class Settings:
    """How a search runs, apart from the model, cluster and options it plans for."""
    memory_budget: float | None = None
    """Bytes per device (None: the device's memory)."""
    mesh_shape: tuple[int, ...] | None = None
    optimizer: str = "adamw"
    time_limit_s: float = 60.0
    """The ILP's time limit per program."""
    verbose: bool = False
    profiler: Any = None
    """Measured op times (``autopar.cost_models.profile``) where it has them."""

    @classmethod
    def of(cls, where: str, keywords: dict) -> "Settings":
        """The settings named by ``keywords`` (those a keyword face such as
        ``flat.plan_captured`` passes on); an unknown name is a TypeError naming ``where``
        and the names it takes."""
        unknown = sorted(set(keywords) - SETTINGS)
        if unknown:
            raise TypeError(f"{where}() got unexpected keyword argument(s) {unknown}; its "
                            f"settings are {sorted(SETTINGS)}")
        mesh = keywords.get("mesh_shape")
        return cls(**{**keywords, "mesh_shape": tuple(mesh) if mesh is not None else None})

    def budget(self, cluster: Cluster) -> float:
        """The memory budget per device in bytes on ``cluster``."""
        return self.memory_budget if self.memory_budget is not None else cluster.device.memory_bytes

    def replace(self, **changes) -> "Settings":
        return replace(self, **changes)


SETTINGS = frozenset(f.name for f in fields(Settings))
"""The names of :class:`Settings`' fields (what a keyword face passes on)."""


@dataclass(frozen=True)
class SearchSpec:
    model: nn.Module
    example_inputs: Any
    """The example batch as the user passed it (capture checks its form)."""
    loss_fn: Callable | None
    """The loss captured in the graph (None: the model returns its own, or it runs outside
    the graph on the replicated output, ``target`` None)."""
    target: Any
    cluster: Cluster
    world: int
    """Devices to plan for (the cluster's by default)."""
    options: Options
    memory_budget: float | None = None
    """Bytes per device (None: the device's memory)."""
    mesh_shape: tuple[int, ...] | None = None
    optimizer: str = "adamw"
    time_limit_s: float = 60.0
    """The ILP's time limit per program."""
    verbose: bool = False
    profiler: Any = None
    """Measured op times (``autopar.cost_models.profile``) where it has them."""

    @property
    def budget(self) -> float:
        """The memory budget per device in bytes."""
        return self.memory_budget if self.memory_budget is not None else self.cluster.device.memory_bytes

    @property
    def batch(self) -> int:
        return int(self.example_inputs[0].shape[0])

    def with_options(self, **changes) -> "SearchSpec":
        return replace(self, options=self.options.replace(**changes))

    @property
    def settings(self) -> Settings:
        """What the searches below the driver pass on whole (:class:`Settings`)."""
        return Settings(self.memory_budget, self.mesh_shape, self.optimizer, self.time_limit_s,
                        self.verbose, self.profiler)


class Planned(NamedTuple):
    """A plan and the graph it runs on: captured at the plan's micro-batch when pipelined
    or accumulating, at the full batch otherwise."""
    plan: Plan
    captured: Captured
