"""``autopar verify --static``: every rank's programs built and checked in one process, with
no process started and nothing run.

For each rank of the plan's mesh (its coordinate; a pipeline's ranks on their stage's mesh)
the programs are built as ``ParallelModule`` builds them (``runtime.program_passes.
rank_programs`` on the plan the rank runs: a stage's, ZeRO-1/2's working plan), from
parameters on the meta device (the shards are shapes only), then

1. each program is type-checked (``runtime.spmd_check.check_program``: types per mesh axis,
   collectives, sharding rules, local shapes, gradients reduced exactly once);
2. for each program, every process group's ranks must issue the same collectives (kind,
   group, elements sent) in the same order: the lists of ``runtime.collective_order.
   graph_collectives`` compared across the simulated ranks by ``first_difference``, the
   check the built module makes over gloo at run time, here before any rank starts. The
   elements sent are the type check's local shapes.

Ranks whose programs are the same program (:func:`program_key`: every node, constant,
parameter shard shape and gradient sync the check reads, the rank's coordinate aside) are
type-checked once: the check is a function of what the key holds, so a second rank of the
same key would repeat the first's walk step by step (a 1-D data-parallel plan's 4 ranks are
one program; a rank with an uneven shard, a context chunk or a pipeline stage of its own is
not). Its collectives are still listed and compared on its own coordinate.

:func:`static_verify` returns one :class:`Result` per rank and program; the command prints
them, one line each, and exits 1 on any failure.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from autopar.device import HOST
from torch import nn

from autopar.analysis.stages import assign_stages
from autopar.capture import Captured
from autopar.errors import StaticCheckError
from autopar.plan import Plan
from autopar.runtime.collective_order import EAGER_FIX, graph_collectives, first_difference
from autopar.runtime.pipeline_runner import stage_plan
from autopar.runtime.program_passes import rank_programs
from autopar.runtime.shards import shard_model
from autopar.runtime.spmd_check import FIX, Context, check_program, fetch_attr, flat_program
from autopar.runtime.zero import optimizer_sharded, working_plan


@dataclass(frozen=True)
class Result:
    """One rank's program: checked (``ok``), or the first problem found (``error``)."""
    rank: int
    coord: tuple[int, ...]
    which: str
    ok: bool
    error: str = ""
    collectives: int = 0
    seconds: float = 0.0


class _Shapes:
    """What ``shard_model`` reads of a model, on the meta device: its parameters' and
    buffers' names, shapes, dtypes and ``requires_grad`` (no memory)."""

    def __init__(self, model: nn.Module):
        self.params = [(n, torch.empty_like(t, device="meta").requires_grad_(t.requires_grad))
                       for n, t in model.named_parameters(remove_duplicate=False)]
        self.buffers = [(n, torch.empty_like(t, device="meta")) for n, t in model.named_buffers()]

    def named_parameters(self, remove_duplicate: bool = True):
        return iter(self.params)

    def named_buffers(self):
        return iter(self.buffers)


def rank_of(coord, mesh_shape) -> int:
    """Row-major rank of ``coord`` (``autopar.ops.comm``'s numbering)."""
    r = 0
    for c, n in zip(coord, mesh_shape):
        r = r * n + c
    return r


def coords(mesh_shape) -> list[tuple[int, ...]]:
    out = [()]
    for n in mesh_shape:
        out = [c + (i,) for c in out for i in range(n)]
    return out


def _groups_by_axis(coord, plan: Plan, inner: int) -> list[tuple[str, str, tuple]]:
    """For the inner (stage) mesh's axis ``a``: (group name, axis name, global ranks) of the
    group ``coord`` belongs to; ``inner``: where the stage mesh starts in ``coord``."""
    mesh = tuple(plan.mesh_shape)
    out = []
    for a in range(inner, len(mesh)):
        ranks = tuple(rank_of(coord[:a] + (i,) + coord[a + 1:], mesh) for i in range(mesh[a]))
        out.append((f"{plan.mesh_axes[a]}{list(ranks)}", plan.mesh_axes[a], ranks))
    return out


class Builder:
    """Builds any rank's programs of ``plan`` (``model``: its parameters' shapes are read,
    not their values)."""

    def __init__(self, cap: Captured, plan: Plan, model: nn.Module):
        self.cap, self.plan = cap, plan
        self.pipelined = plan.pipeline_stages > 1
        run_plan = working_plan(plan) if optimizer_sharded(plan) else plan
        self.run_splan = stage_plan(run_plan) if self.pipelined else run_plan
        self.stage_of = (assign_stages(cap, plan.stage_cuts, plan.pipeline_stages * plan.virtual_stages)
                         if self.pipelined else None)
        self.shapes = _Shapes(model)
        self.inner = 1 if self.pipelined else 0
        self.rules: dict = {}         # the sharding rules' strategies, shared by every rank

    def build(self, coord: tuple[int, ...]):
        """(programs by name, the context of each program's check)."""
        local = coord[self.inner:]
        root, shards = shard_model(self.cap, self.run_splan, local, self.shapes, torch.device("meta"),
                                   meta_ok=True)
        built = rank_programs(self.cap, self.run_splan, self.pipelined, local, torch.device(HOST),
                              root, shards.attr_of, self.stage_of)
        stepped = "train" if self.cap.has_loss else "forward"
        ctx = {which: Context(which, self.cap, self.run_splan, shards.attr_of, built.loss_sync,
                              built.grad_sync if which == stepped else None, self.rules)
               for which in built.programs}
        return built.programs, ctx


def program_key(gm, ctx: Context) -> str:
    """What :func:`check_program` reads of a (flat) program and its context, as text: each
    node's op, name, target, arguments (constants included, nodes by name), the captured node
    it runs and the inputs it reads by name; each attribute tensor's shape and dtype (the
    check runs on FakeTensors: values are not read); the context's parameter attributes, the
    loss's and the gradients' sync axes. Equal keys, equal checks. An argument whose text
    holds an object's address makes every rank's key its own: checked again, never merged."""
    parts = [ctx.which, repr(sorted(ctx.attr_of.items())), repr(tuple(ctx.loss_sync)),
             repr(sorted((ctx.grad_sync or {}).items()))]
    for n in gm.graph.nodes:
        target = n.target if isinstance(n.target, str) else (
            f"{getattr(n.target, '__module__', '')}.{getattr(n.target, '__qualname__', n.target)}")
        inputs = [getattr(i, "name", i) for i in n.meta.get("inputs", ())]
        parts.append(f"{n.op}|{n.name}|{target}|{n.args!r}|{n.kwargs!r}|{n.meta.get('source')!r}|{inputs}")
        if n.op == "get_attr":
            t = fetch_attr(gm, n.target)
            if isinstance(t, torch.Tensor):
                parts.append(f"  {tuple(t.shape)} {t.dtype}")
    return "\n".join(parts)


def static_verify(cap: Captured, plan: Plan, model: nn.Module, ranks=None) -> list[Result]:
    """Build and check every rank's programs of ``plan`` (module docstring). ``model``: the
    model the capture was made from (its parameters' shapes are read, not their values);
    ``ranks``: type-check only these ranks (every rank's collectives are compared)."""
    b = Builder(cap, plan, model)
    results: list[Result] = []
    sequences: dict[str, dict[int, tuple]] = {}
    checked: dict[str, tuple[dict, str]] = {}     # program_key -> (local sizes, error)
    for coord in coords(plan.mesh_shape):
        rank = rank_of(coord, plan.mesh_shape)
        t0 = time.perf_counter()
        try:
            programs, ctx = b.build(coord)
        except Exception as e:  # noqa: BLE001 - a build that fails is this rank's finding
            results.append(Result(rank, coord, "build", False, f"{type(e).__name__}: {e}"))
            continue
        build_s = (time.perf_counter() - t0) / max(len(programs), 1)
        for which, gm in programs.items():
            t1 = time.perf_counter()
            sizes, error = {}, ""
            flat = flat_program(gm)
            if ranks is None or rank in ranks:
                key = program_key(flat, ctx[which])
                if key not in checked:
                    try:
                        checked[key] = (check_program(flat, ctx[which]), "")
                    except StaticCheckError as e:
                        checked[key] = ({}, str(e))
                sizes, error = checked[key]
            seq = graph_collectives(flat, _groups_by_axis(coord, plan, b.inner))
            seq = [c if c.numel is not None or c.of not in sizes else replace(c, numel=sizes[c.of])
                   for c in seq]
            sequences.setdefault(which, {})[rank] = (f"the {which} program", seq)
            results.append(Result(rank, coord, which, not error, error, len(seq),
                                  build_s + time.perf_counter() - t1))
    for which, by_rank in sequences.items():
        problem = first_difference(by_rank, f"{EAGER_FIX}; {FIX}")
        if problem is not None:
            results = [r if r.which != which or not r.ok else
                       replace(r, ok=False, error=f"collective order: {problem}") for r in results]
    return results


def first_error(results: list[Result]) -> str | None:
    bad = next((r for r in results if not r.ok), None)
    return None if bad is None else f"rank {bad.rank} {bad.which}: {bad.error}"


def raise_on_error(results: list[Result]) -> None:
    problem = first_error(results)
    if problem is not None:
        raise StaticCheckError(problem)
