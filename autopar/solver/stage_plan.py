"""The stage DP's input and output: per-layer costs of a chain (:class:`LayerCosts`) and the
pipeline decision (:class:`StagePlan`); the model they follow is in ``stage_dp``'s docstring."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from autopar.errors import AutoparInputError
from autopar.schedule import torch_schedule_class

__all__ = ["LayerCosts", "StagePlan", "StagesDoNotFit"]


class StagesDoNotFit(AutoparInputError):
    """No cut of the chain into stages fits the memory limit (``plan_stages``)."""


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer costs of a chain of L layers, for one sample on one device."""

    time: Sequence[float]
    """Forward + backward seconds of layer i, per sample."""
    state_bytes: Sequence[float]
    """Parameters + gradients + optimizer state of layer i."""
    activation_bytes: Sequence[float]
    """Activations layer i saves for backward, per sample."""
    boundary_bytes: Sequence[float]
    """Bytes per sample crossing a cut after layer i, for i = 0 .. L-2 (length L - 1)."""
    fixed_time: Sequence[float] | None = None
    """Seconds of layer i per micro-batch that do not shrink with the micro-batch size or
    the sub-mesh (kernel launches, small-op latency); None = zeros. It is what makes many
    tiny micro-batches cost something."""
    sync_bytes: Sequence[float] | None = None
    """Bytes of layer i all-reduced across its stage's sub-mesh once per step (gradients
    under data parallelism); None = zeros."""
    action_time: float = 0.0
    """Seconds the pipeline runtime adds to every action of a stage (F and B, or F, I and W
    under zero bubble) whatever its layers: ``Device.pipeline_action``."""
    boundary_tensors: Sequence[float] | None = None
    """Tensors crossing a cut after layer i, for i = 0 .. L-2 (None = zeros): each is a
    message of its own per micro-batch, forward (the value) and backward (its gradient)."""
    message_time: float = 0.0
    """Seconds of latency per message between neighbouring stages (the link's alpha of a
    send), paid by both stages of a cut (``stage_tables.cut_latency``)."""
    forward_fraction: float = 1 / 3
    """Forward's share of ``time`` (backward = 2 x forward, as Megatron-LM assumes)."""
    weight_fraction: float = 0.5
    """Weight-gradient share of the backward (zero-bubble's W; the rest is I)."""
    parameters: Sequence[float] | None = None
    """Parameters layer i reads (> 0: it reads one). A stage holds the parameters of its
    layers; a stage of layers reading none trains nothing (its rank's optimizer has an
    empty parameter list) and is never planned. None = every layer reads one."""
    host_time: Sequence[float] | None = None
    """Host seconds of layer i per micro-batch: its eager program's ATen calls, forward and
    backward, dispatched on the rank's CPU (``cost_models.host``; GPU ranks only). None =
    zeros (CPU ranks, whose host is the device: their dispatch is in ``fixed_time``)."""
    host_step_time: float = 0.0
    """Host seconds a rank spends once per step whatever its layers: the optimizer's
    foreach calls (``cost_models.host.OPTIMIZER_DISPATCHES``)."""
    grad_boundary_bytes: Sequence[float] | None = None
    """Of ``boundary_bytes``, the bytes per sample of the values a gradient comes back
    through (computed from a parameter), cut by cut. Given, a stage's memory counts the
    pipeline runtime's receive buffers (``stage_dp``'s memory model); None: not counted."""
    time_floors: tuple | None = None
    """(layer, per_sample, floor): three equal-length arrays, one entry per op whose
    micro-batch takes at least ``floor`` seconds however few its samples (a GEMM reading
    its weights; ``pipeline_costs.NodeCosts.weight_floor``), in ``layer``, whose ``time``
    counts it at ``per_sample`` seconds a sample. A micro-batch of b samples then costs
    that layer ``max(0, floor - per_sample * b)`` more (:meth:`floor_excess`). None: no
    such op (``time`` is linear in the micro-batch)."""

    def __post_init__(self):
        for name in ("fixed_time", "sync_bytes", "host_time"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros(len(self.time)))
        if self.parameters is None:
            object.__setattr__(self, "parameters", np.ones(len(self.time)))
        if self.boundary_tensors is None:
            object.__setattr__(self, "boundary_tensors", np.zeros(max(len(self.time) - 1, 0)))
        if not (math.isfinite(self.message_time) and self.message_time >= 0):
            raise ValueError(f"LayerCosts.message_time must be finite and >= 0, got {self.message_time}")
        if not (math.isfinite(self.host_step_time) and self.host_step_time >= 0):
            raise ValueError(f"LayerCosts.host_step_time must be finite and >= 0, got {self.host_step_time}")
        arrays = {}
        for name in ("time", "state_bytes", "activation_bytes", "boundary_bytes", "fixed_time",
                     "sync_bytes", "boundary_tensors", "parameters", "host_time"):
            arr = np.asarray(getattr(self, name), dtype=float)
            if arr.ndim != 1:
                raise ValueError(f"LayerCosts.{name} must be one-dimensional, got shape {arr.shape}")
            if not np.isfinite(arr).all() or (arr < 0).any():
                raise ValueError(f"LayerCosts.{name} must be finite and >= 0")
            arrays[name] = arr
        n = arrays["time"].shape[0]
        if n == 0:
            raise ValueError("LayerCosts needs at least one layer")
        for name in ("state_bytes", "activation_bytes", "fixed_time", "sync_bytes", "parameters",
                     "host_time"):
            if arrays[name].shape[0] != n:
                raise ValueError(f"LayerCosts.{name} has {arrays[name].shape[0]} entries for {n} layers")
        if self.grad_boundary_bytes is not None:
            arr = np.asarray(self.grad_boundary_bytes, dtype=float)
            if arr.ndim != 1 or not np.isfinite(arr).all() or (arr < 0).any():
                raise ValueError("LayerCosts.grad_boundary_bytes must be one-dimensional, finite and >= 0")
            arrays["grad_boundary_bytes"] = arr
        for name in ("boundary_bytes", "boundary_tensors", "grad_boundary_bytes"):
            if name in arrays and arrays[name].shape[0] != n - 1:
                raise ValueError(f"LayerCosts.{name} needs one entry per cut point ({n - 1} for "
                                 f"{n} layers), got {arrays[name].shape[0]}")
        if self.time_floors is not None:
            floors = tuple(np.asarray(a, dtype=t) for a, t in zip(self.time_floors, (np.int64, float, float)))
            if any(a.ndim != 1 for a in floors) or len({len(a) for a in floors}) != 1 \
                    or ((floors[0] < 0) | (floors[0] >= n)).any() \
                    or not all(np.isfinite(a).all() and (a >= 0).all() for a in floors[1:]):
                raise ValueError("LayerCosts.time_floors must be three one-dimensional arrays of "
                                 "equal length: layer indices in range, finite per-sample and "
                                 "floor seconds >= 0")
            object.__setattr__(self, "time_floors", floors)
        if not (0 < self.forward_fraction < 1 and 0 <= self.weight_fraction <= 1):
            raise ValueError("forward_fraction must be in (0, 1) and weight_fraction in [0, 1]")
        for name, arr in arrays.items():
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)

    @property
    def n_layers(self) -> int:
        return len(self.time)

    def floor_excess(self, samples: float) -> np.ndarray:
        """Per layer, the seconds a micro-batch of ``samples`` samples (per device) takes
        beyond ``time * samples + fixed_time``: each of :attr:`time_floors`' ops'
        ``floor - per_sample * samples`` where positive (zeros without floors)."""
        if self.time_floors is None:
            return np.zeros(self.n_layers)
        layer, per, floor = self.time_floors
        return np.bincount(layer, weights=np.maximum(floor - per * samples, 0.0),
                           minlength=self.n_layers)

    def micro_batch_time(self, samples: float) -> np.ndarray:
        """Per layer, the seconds of one micro-batch of ``samples`` samples per device:
        ``time * samples + fixed_time`` and the :meth:`floor_excess`."""
        return self.time * samples + self.fixed_time + self.floor_excess(samples)

    @property
    def n_learned(self) -> int:
        """Layers that read a parameter: the most stages that can each hold one."""
        return int((self.parameters > 0).sum())

    def host_floor(self, p: int, m: int) -> float:
        """A floor of the busiest of ``p`` ranks' host seconds a step for ``m`` micro-batches:
        at least 1/p of every layer's calls, and the longest layer's, m times, plus the
        optimizer's (``stage_dp``'s host rule)."""
        if not self.host_time.any():
            return self.host_step_time
        h = self.host_time
        return m * max(float(h.sum()) / p, float(h.max())) + self.host_step_time

    def split(self) -> tuple[float, float, float]:
        """Fractions (F, I, W) of a stage's forward + backward time."""
        f = self.forward_fraction
        return f, (1 - f) * (1 - self.weight_fraction), (1 - f) * self.weight_fraction


@dataclass(frozen=True)
class StagePlan:
    """The pipeline decision: where the chain is cut, how it is scheduled, what it costs."""

    cuts: tuple[int, ...]
    """First layer of stages 1 .. S-1 (S = n_stages * virtual_stages); stage k holds
    layers cuts[k-1] .. cuts[k] - 1."""
    n_stages: int
    """Pipeline ranks p."""
    micro_batches: int
    schedule: str
    virtual_stages: int
    """Stages per rank v; stage k runs on rank k mod n_stages."""
    devices_per_stage: int
    """Devices of each rank's data/tensor sub-mesh (n_devices / n_stages)."""
    stage_times: tuple[float, ...]
    """Forward + backward seconds of each of the S stages for one micro-batch."""
    boundary_times: tuple[float, ...]
    """One-way transfer seconds across each of the S - 1 cuts for one micro-batch."""
    predicted_step_time: float
    """Pipeline time (what ``simulate_plan`` times) + ``sync_time`` (or the optimizer's host
    calls, ``LayerCosts.host_step_time``, where they take longer), or ``host_time`` where
    that is more (``stage_dp``'s host rule)."""
    bubble_fraction: float
    """1 - busy area / (ranks x pipeline time), idle from fill, drain and imbalance."""
    memory_per_stage: tuple[float, ...]
    """Peak bytes per device of each pipeline rank (its v stages together)."""
    sync_time: float = 0.0
    """Once-per-step all-reduce of the slowest rank's ``sync_bytes`` over its sub-mesh."""
    host_time: float = 0.0
    """The busiest rank's host seconds a step (``stage_dp``'s host rule); the
    ``predicted_step_time`` is at least this."""
    forward_fraction: float = 1 / 3
    weight_fraction: float = 0.5
    n_layers: int = field(default=0)

    @property
    def stage_layers(self) -> tuple[tuple[int, int], ...]:
        """(first, last + 1) layer of every stage."""
        bounds = (0, *self.cuts, self.n_layers)
        return tuple(zip(bounds[:-1], bounds[1:]))

    @property
    def torch_schedule(self) -> type:
        return torch_schedule_class(self.schedule)
