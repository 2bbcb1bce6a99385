"""The rewrite of a rank's programs, as one declared list: :data:`PASSES`.

Each entry is a :class:`ProgramPass`: its name, the condition under which it runs (a
predicate over :class:`RankProgram`, the plan and program being rewritten, stated once
here) and its function. A rank's program is the fold of the list over the captured graph
(:func:`rank_programs`): the first pass, ``insert_collectives``, builds the per-rank
program and the data the step needs beside it (``passes.insert_collectives.Rewritten``:
the program, the axes each data-parallel gradient is summed over, and those the loss is
still to be summed over); every later pass maps that program to a new one and keeps the
data. No pass changes a program anyone else holds: run alone (``ProgramPass.run``), a
pass that edits a graph in place edits a copy (``passes.copy_program``: new graphs and
code, the same parameter tensors); in the fold (:func:`rewrite`) it edits the program an
earlier pass of the same fold made, which nothing else holds, and copies only what it did
not make. The copies would cost 1.1-3.2x the programs' build time (``benchmarks/
pass_copy_cost.py``: a Llama of 157 nodes under ZeRO-3 and bf16, 1.85 s against 0.71 s).

The order, and why:

1. ``insert_collectives``: the captured global graph and the plan -> the per-rank program
   (``train`` returns this rank's term of the loss, deferred beside backward when neither
   pipelined nor branched; ``forward`` returns the model's outputs, replicated).
2. ``check_grad_sync``: the program whose gradients the step syncs (``train``, or
   ``forward`` without a loss) sums every parameter's gradient exactly where it is partial
   (``passes.check_grad_sync``), or an internal error before anything runs.
3. ``low_precision_gathers``: under ZeRO-3 and 16-bit precision, weights that only feed
   16-bit ops are gathered in 16 bits (``passes.autocast``).
   Under ``precision="fp8"`` too (its non-fp8 part is bf16).
4. ``fp8_linear_calls``: under ``precision="fp8"``, the plan's fp8 linears call
   ``ops.fp8.fp8_linear`` with the axes their amaxes are reduced over (``passes.fp8_linears``);
   ``fp8_experts_calls``: the plan's fp8 experts ops run their GEMMs so (``ops.fp8_experts``).
4b. ``fp8_weight_gathers``: under ``Options.fp8_gathers`` (fp8, tensorwise, ZeRO-3, eager),
   the ZeRO-3 gathers of fp8 linears' weights move float8 (``passes.fp8_gathers``); before
   the prefetch, which buckets them apart (their dtype).
5. ``prefetch_gathers``: ZeRO-3's gathers bucketed by block and started one block early
   (``passes.prefetch``); not under a pipeline (its stages are cut later), recomputation
   (a recomputed layer gathers its own again) or ``compile`` (Inductor places them).
6. ``checkpoint_layers``: the plan's recomputed layers run under ``torch.utils.checkpoint``
   (``passes.recompute``), in the ``train`` program of an unpipelined plan (a pipeline
   checkpoints each stage's share after cutting it, ``runtime.pipeline_runner``).
6b. ``offload_layers``: the plan's offloaded layers (``options.offload_activations``) keep
   what they save for backward in host memory (``passes.offload_activations``), in the
   ``train`` program of an unpipelined plan (a pipeline offloads each stage's share after
   cutting it, ``runtime.pipeline_runner``); after ``checkpoint_layers`` (a layer is one or
   the other) and, like it, with ZeRO-3's prefetch off (its gathers would cross the regions).
7. ``keep_branches``: branch parallelism keeps this rank's branches (``passes.branch_parallel``).
8. ``place_on``: tensors the program creates go on the rank's device (``passes.place_on_device``).
9. ``fast_bindings``: last, ops called through torch's Python bindings (``passes.fast_bindings``);
   not under ``compile`` (Inductor traces the overloads).

A new pass is a row here (its condition included) and a file in ``passes/``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import nn
from torch.fx import GraphModule

from autopar.analysis.layers import layer_members, select_layers
from autopar.capture import Captured
from autopar.passes.autocast import low_precision_gathers
from autopar.passes.branch_parallel import keep_branches
from autopar.passes.check_grad_sync import check_grad_sync
from autopar.passes.copy_program import copy_program
from autopar.passes.fast_bindings import fast_bindings
from autopar.passes.fp8_gathers import fp8_weight_gathers
from autopar.passes.fp8_linears import fp8_experts_calls, fp8_linear_calls
from autopar.passes.insert_collectives import Rewritten, insert_collectives
from autopar.passes.place_on_device import place_on
from autopar.passes.prefetch import prefetch_gathers
from autopar.passes.offload_activations import offload_layers
from autopar.passes.recompute import checkpoint_layers
from autopar.plan import Plan
from autopar.runtime.precision import compute_dtype


@dataclass(frozen=True)
class RankProgram:
    """What a pass reads about the program it rewrites: which program (``"train"``, the
    loss's, or ``"forward"``, the model's outputs), the capture, the plan the program runs
    (a stage's, ``stage_plan``, under a pipeline; ZeRO-1/2's working plan), whether the plan
    is pipelined, this rank's coordinate on that plan's mesh, its device, the module
    holding its shards (``root``) and each parameter placeholder's attribute path on it;
    under a pipeline, the stage of every captured node (``stage_of``)."""
    which: str
    cap: Captured
    plan: Plan
    pipelined: bool
    coord: tuple[int, ...]
    device: torch.device
    root: nn.Module = field(repr=False)
    attr_of: dict[str, str] = field(repr=False)
    stage_of: dict[str, int] | None = field(default=None, repr=False)

    @property
    def stepped(self) -> bool:
        """Whether the step syncs this program's gradients: ``train``, or ``forward`` when
        the capture has no loss."""
        return self.which == ("train" if self.cap.has_loss else "forward")

    @property
    def options(self):
        return self.plan.options


@dataclass(frozen=True)
class ProgramPass:
    """One rewrite of a rank's program: it runs when ``applies(program)``; ``run`` maps the
    rewrite so far (None before the first pass) to a new one, leaving its input as it was.
    ``edit``: for a pass that edits a graph in place, that edit (``run`` applies it to a
    copy; the fold applies it to a program it made). ``builds``: whether ``run`` returns a
    program of its own (False for a check that returns its input)."""
    name: str
    applies: Callable[[RankProgram], bool]
    run: Callable[["Rewritten | None", RankProgram], Rewritten]
    edit: Callable[[GraphModule, RankProgram], object] | None = None
    builds: bool = True


def in_place(name: str, applies: Callable[[RankProgram], bool],
             edit: Callable[[GraphModule, RankProgram], object]) -> ProgramPass:
    """A pass from a rewrite that edits a graph in place (returning a count)."""
    return ProgramPass(name, applies, on_a_copy(edit), edit)


def on_graph(rewrite: Callable[[GraphModule, RankProgram], GraphModule]):
    """A pass over the program alone (GraphModule -> GraphModule), the step's data kept."""
    return lambda rw, p: replace(rw, gm=rewrite(rw.gm, p))


def on_a_copy(edit: Callable[[GraphModule, RankProgram], object]):
    """A pass from a rewrite that edits a graph in place (returning a count): it edits a
    copy (``passes.copy_program``), so its input is left as it was."""
    def rewrite(gm: GraphModule, p: RankProgram) -> GraphModule:
        out = copy_program(gm)
        edit(out, p)
        return out
    return on_graph(rewrite)


def _insert_collectives(rw: None, p: RankProgram) -> Rewritten:
    defer_loss = p.which == "train" and not p.pipelined and not p.plan.branches
    return insert_collectives(p.cap, p.plan, p.root, p.attr_of, "loss" if p.which == "train" else "model",
                              defer_loss=defer_loss, stage_of=p.stage_of)


def _check_grad_sync(rw: Rewritten, p: RankProgram) -> Rewritten:
    check_grad_sync(rw.gm, rw.grad_sync, p.cap, p.plan, p.attr_of)
    return rw


def _always(p: RankProgram) -> bool:
    return True


def _zero3(p: RankProgram) -> bool:
    return p.options.zero_stage >= 3


def _offloads(p: RankProgram) -> bool:
    """Whether the plan offloads layers' saved activations (``offload_activations=``)."""
    return p.options.offload_activations not in (None, "none", ())


PASSES: tuple[ProgramPass, ...] = (
    ProgramPass("insert_collectives", _always, _insert_collectives),
    ProgramPass("check_grad_sync", lambda p: p.stepped, _check_grad_sync, builds=False),
    in_place("low_precision_gathers", lambda p: _zero3(p) and compute_dtype(p.options) is not None,
             lambda gm, p: low_precision_gathers(gm, compute_dtype(p.options))),
    in_place("fp8_linear_calls", lambda p: p.options.precision == "fp8",
             lambda gm, p: fp8_linear_calls(gm, p.cap, p.plan)),
    in_place("fp8_experts_calls", lambda p: p.options.precision == "fp8",
             lambda gm, p: fp8_experts_calls(gm, p.cap, p.plan)),
    in_place("fp8_weight_gathers", lambda p: p.options.fp8_gathers, lambda gm, p: fp8_weight_gathers(gm)),
    in_place("prefetch_gathers", lambda p: _zero3(p) and not p.pipelined and not p.plan.recompute
             and not _offloads(p) and not p.options.compile, lambda gm, p: prefetch_gathers(gm)),
    ProgramPass("checkpoint_layers", lambda p: p.which == "train" and bool(p.plan.recompute)
                and not p.pipelined,      # builds a new GraphModule; the input's shards shared
                on_graph(lambda gm, p: checkpoint_layers(gm, layer_members(p.cap.gm, p.plan.recompute)))),
    ProgramPass("offload_layers", lambda p: p.which == "train" and _offloads(p) and not p.pipelined,
                on_graph(lambda gm, p: offload_layers(gm, layer_members(p.cap.gm, select_layers(
                    p.cap.gm, p.options.offload_activations, "offload_activations")), p.device))),
    in_place("keep_branches", lambda p: bool(p.plan.branches),
             lambda gm, p: keep_branches(gm, p.cap, p.plan, p.coord, p.attr_of)),
    in_place("place_on", _always, lambda gm, p: place_on(gm, p.device)),
    in_place("fast_bindings", lambda p: not p.options.compile, lambda gm, p: fast_bindings(gm)),
)
"""The passes, in the order they run (module docstring)."""


def applied(program: RankProgram, passes: tuple[ProgramPass, ...] = PASSES) -> tuple[str, ...]:
    """The names of the passes that rewrite ``program``, in order."""
    return tuple(ps.name for ps in passes if ps.applies(program))


def rewrite(program: RankProgram, passes: tuple[ProgramPass, ...] = PASSES) -> Rewritten:
    """``program`` rewritten: the fold of ``passes`` (those that apply) from the capture.
    A pass that edits in place edits the program in hand when an earlier pass of this fold
    made it (``owned``: nothing else holds it), else a copy."""
    rw, owned = None, False
    for ps in passes:
        if not ps.applies(program):
            continue
        if ps.edit is not None and owned:
            ps.edit(rw.gm, program)
        else:
            rw = ps.run(rw, program)
            owned = owned or ps.builds
    return rw


@dataclass(frozen=True)
class RankPrograms:
    """A rank's programs by name (``"train"`` when the capture has the loss, ``"forward"``),
    the mesh axes each data-parallel gradient is summed over once per step (``grad_sync``),
    those the train program's loss is still to be summed over (``loss_sync``), and the
    passes each program went through (``passes``)."""
    programs: dict[str, GraphModule]
    grad_sync: dict[str, tuple[int, ...]]
    loss_sync: tuple[int, ...]
    passes: dict[str, tuple[str, ...]]


def rank_programs(cap: Captured, plan: Plan, pipelined: bool, coord: tuple[int, ...],
                  device: torch.device, root: nn.Module, attr_of: dict[str, str],
                  stage_of: dict[str, int] | None = None) -> RankPrograms:
    """This rank's programs under ``plan`` (the plan they run: :class:`RankProgram`)."""
    made = {}
    for which in (("train",) if cap.has_loss else ()) + ("forward",):
        made[which] = RankProgram(which, cap, plan, pipelined, tuple(coord), device, root,
                                  attr_of, stage_of)
    done = {which: rewrite(p) for which, p in made.items()}
    stepped = next(which for which, p in made.items() if p.stepped)
    return RankPrograms({which: rw.gm for which, rw in done.items()}, dict(done[stepped].grad_sync),
                        done["train"].loss_sync if "train" in done else (),
                        {which: applied(p) for which, p in made.items()})
