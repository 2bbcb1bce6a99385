"""Proven before it runs: every rank of each process group issues the same collectives
(kind, group, size) in the same order, or the program is refused before its first step.

Two ranks that issue one group's collectives in different orders wait for each other for
ever (issue 43: torchtitan's Llama 3 under ``compile=True``, ZeRO-3, hung with rank 0 in a
bucketed all-gather and rank 1 in a reduce-scatter). Each rank lists what its program will
issue, the ranks that run the same programs exchange the lists through the job's store
(:class:`OrderCheck`), and every rank compares them the same way,
so that all raise the same :class:`CollectiveOrderError`, naming the first collective where
two ranks of a group differ, instead of hanging.

What is listed:

- eager programs (:func:`graph_collectives`): the rewritten fx graph's calls of
  ``autopar.ops.collectives`` in graph order, the order eager execution issues them;
- compiled programs (:func:`inductor_collectives`): the code Inductor generated for each
  forward and backward graph, read when it is compiled (:func:`checked_backend`), before it
  runs. Inductor issues the functional collectives in the order of its final FX graph
  (``torch._inductor.comms.decide_global_ordering_of_comms`` chains them, so that neither
  fusion nor its memory reordering moves one past another), which is the order the code
  lists them in.

A group's collectives are compared by kind, group and the number of elements this rank
sends (read from the generated code; ``None`` where the code does not say).
"""
from __future__ import annotations

import itertools
import pickle
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from autopar.ops.fault_notice import job_store

DEFAULT_TIMEOUT_S = default_pg_timeout.total_seconds()
"""How long a rank waits for the others' lists where the job set no collective timeout:
torch's default process-group timeout (30 minutes), which the check's gloo gather had."""


class CollectiveOrderError(RuntimeError):
    """The ranks of one process group would issue different collectives (or the same in
    another order): run together, they would wait for each other for ever."""


@dataclass(frozen=True)
class Collective:
    """One collective a program issues."""
    kind: str                      # "all_gather", "reduce_scatter", "all_reduce", ...
    group: str                     # the process group's name (c10d's, the same on every rank)
    axis: str                      # the mesh axis it runs on ("?" when not one of the mesh's)
    ranks: tuple[int, ...]         # the group's ranks
    numel: int | None = None       # elements this rank sends; None where not known
    of: str = ""                   # an eager program's: the graph node it sends

    def key(self) -> tuple:
        return (self.kind, self.group, self.numel, self.of)

    def __str__(self) -> str:
        size = f"{self.numel:,} elements" if self.numel is not None else "unknown size"
        of = f" of node {self.of!r}" if self.of else ""
        return (f"{self.kind}{of} ({size}) on mesh axis {self.axis!r} "
                f"(group ranks {list(self.ranks)})")


# --- what a program issues ------------------------------------------------------------------

_FUNCOL_KIND = {
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast",
}
_CALL = re.compile(r"torch\.ops\._c10d_functional\.(\w+)\.default\((.*)\)\s*$")
_GROUP = re.compile(r"'([^']*)'")
_DIMS = r"\(([^()]*)\)"
_DEFINES = [re.compile(rf"^\s*(\w+) = empty_strided_\w+\({_DIMS}"),
            re.compile(rf"^\s*(\w+) = reinterpret_tensor\(\w+, {_DIMS}"),
            re.compile(rf"assert_size_stride\((\w+), {_DIMS}")]
_REINTERPRET = re.compile(rf"^reinterpret_tensor\(\w+, {_DIMS}")


def _numel(dims: str) -> int | None:
    """``"2, 32, 4, "`` -> 256; None for a symbolic size."""
    parts = [d.strip() for d in dims.split(",") if d.strip()]
    if not all(p.isdigit() for p in parts):
        return None
    n = 1
    for p in parts:
        n *= int(p)
    return n


def _first_arg(args: str) -> str:
    depth = 0
    for i, ch in enumerate(args):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            return args[:i].strip()
    return args.strip()


def inductor_collectives(source: str, groups: dict[str, tuple[str, tuple[int, ...]]]
                         ) -> list[Collective]:
    """The collectives in Inductor's generated Python ``source`` (its wrapper code), in the
    order it issues them. ``groups``: process group name -> (mesh axis name, ranks); a
    group not in it is named by itself. The size sent is the first argument's: a
    ``reinterpret_tensor`` names its shape; a buffer or graph input its shape where it is
    allocated, aliased or checked (``assert_size_stride``) earlier in the code."""
    shapes: dict[str, int | None] = {}
    out = []
    for line in source.splitlines():
        for pattern in _DEFINES:
            m = pattern.search(line)
            if m:
                shapes[m.group(1)] = _numel(m.group(2))
        m = _CALL.search(line)
        if not m or m.group(1) not in _FUNCOL_KIND:
            continue
        args = m.group(2).split(", out=")[0]
        names = _GROUP.findall(args)
        group = names[-1] if names else "?"
        first = _first_arg(args)
        r = _REINTERPRET.match(first)
        numel = _numel(r.group(1)) if r else shapes.get(first)
        axis, ranks = groups.get(group, (group, ()))
        out.append(Collective(_FUNCOL_KIND[m.group(1)], group, axis, tuple(ranks), numel))
    return out


# the graph's calls that communicate (autopar.ops.collectives; scatter and to_partial do not)
_GRAPH_KINDS = {"all_gather": "all_gather", "all_reduce": "all_reduce",
                "grad_all_reduce": "all_reduce (backward)", "reduce_scatter": "reduce_scatter",
                "all_to_all": "all_to_all", "all_to_all_v": "all_to_all"}


def graph_collectives(gm: torch.fx.GraphModule, groups_by_axis: Sequence[tuple[str, str, tuple]]
                      ) -> list[Collective]:
    """The calls of ``autopar.ops.collectives`` in ``gm``'s graph, in graph order (the order
    an eager program issues them). ``groups_by_axis[a]``: mesh axis ``a``'s (group name,
    axis name, ranks). The size is the input's local shape where the node records it."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or getattr(n.target, "__module__", "") != "autopar.ops.collectives":
            continue
        kind = _GRAPH_KINDS.get(n.target.__name__)
        if kind is None:
            continue
        axis = n.kwargs.get("axis", n.args[1] if len(n.args) > 1 else None)
        if not isinstance(axis, int) or not 0 <= axis < len(groups_by_axis):
            continue
        group, name, ranks = groups_by_axis[axis]
        src = n.args[0] if n.args else None
        val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
        numel = val.numel() if isinstance(val, torch.Tensor) else None
        numel = numel if isinstance(numel, int) else None        # a symbolic size: unknown
        out.append(Collective(kind, group, name, tuple(ranks), numel,
                              src.name if isinstance(src, torch.fx.Node) else ""))
    return out


# --- the comparison -------------------------------------------------------------------------

def first_difference(by_rank: dict[int, tuple[str, list[Collective]]], fix: str) -> str | None:
    """None when, for every process group, its ranks' lists of that group's collectives are
    equal; else the message naming the first collective where two of its ranks differ.
    ``by_rank``: rank -> (the program being checked, its collectives)."""
    programs = {r: w for r, (w, _) in by_rank.items()}
    if len(set(programs.values())) > 1:
        return ("the ranks reached the collective-order check in different programs "
                f"({', '.join(f'rank {r}: {w}' for r, w in sorted(programs.items()))}): they "
                f"run different programs, or one compiled a program again; {fix}")
    members: dict[str, tuple[int, ...]] = {}
    for _, seq in by_rank.values():
        for c in seq:
            members.setdefault(c.group, c.ranks)
    for group in sorted(members):
        ranks = [r for r in members[group] if r in by_rank] or sorted(by_rank)
        subs = {r: [c for c in by_rank[r][1] if c.group == group] for r in ranks}
        first = ranks[0]
        for r in ranks[1:]:
            a, b = subs[first], subs[r]
            k = next((i for i, (x, y) in enumerate(zip(a, b)) if x.key() != y.key()), None)
            if k is None and len(a) == len(b):
                continue
            k = min(len(a), len(b)) if k is None else k

            def at(seq, i):
                return str(seq[i]) if i < len(seq) else f"nothing (it issues {len(seq)} on this group)"
            which = programs[first]
            return (f"the ranks of one process group would issue different collectives in "
                    f"{which}: the group's collective #{k} is, on rank {first}, {at(a, k)}, and "
                    f"on rank {r}, {at(b, k)}. Run together they would wait for each other for "
                    f"ever; {fix}")
    return None


class OrderCheck:
    """Compares what ``ranks`` (the ranks that run the same programs) will issue;
    ``groups``: process group name -> (mesh axis name, ranks), the names the lists use.
    Every rank of ``ranks`` must call :meth:`check` at the same point (before the same
    program's first run).

    The lists meet in the job's store (``ops.fault_notice.job_store``: the TCPStore every
    rank reaches), not in a gloo collective: a compiled program is checked while Inductor
    compiles it, and a gloo all-gather issued there hung the ranks now and then on a cold
    Inductor cache (``tests/test_compile.py`` in CI, 2 of ~8 cold launches here: both ranks
    in the check's ``all_gather_object``, one of them blocked submitting its second
    all-gather); a store key is a socket round trip, with no gloo worker thread and no
    tensor. ``key``: this check's prefix, the same on every rank of ``ranks``; each call
    writes under ``<key>/<n>/<rank>`` and waits at most ``timeout_s`` for the others'."""

    def __init__(self, ranks: Sequence[int], groups: dict[str, tuple[str, tuple[int, ...]]],
                 key: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.ranks, self.groups, self.key, self.timeout_s = tuple(ranks), groups, key, timeout_s
        self.checked: list[str] = []          # what was checked here, in order

    def check(self, which: str, seq: list[Collective], fix: str) -> None:
        store, rank = job_store(), dist.get_rank()
        at = f"{self.key}/{len(self.checked)}"
        store.set(f"{at}/{rank}", pickle.dumps((which, seq)))
        keys = [f"{at}/{r}" for r in self.ranks]
        try:
            store.wait(keys, timedelta(seconds=self.timeout_s))
        except RuntimeError as e:       # DistStoreError: a rank never came
            missing = [r for r, k in zip(self.ranks, keys) if not store.check([k])]
            raise CollectiveOrderError(
                f"{which}: rank(s) {missing} did not reach the collective-order check within "
                f"{self.timeout_s:.0f} s (ranks {list(self.ranks)} check their programs together "
                f"before the first step): a rank failed or is still compiling; its own error says "
                f"which, or raise autopar.parallelize(..., timeout=)") from e
        gathered = {r: pickle.loads(store.get(k)) for r, k in zip(self.ranks, keys)}
        problem = first_difference(gathered, fix)
        if problem is not None:
            raise CollectiveOrderError(problem)
        self.checked.append(which)


COMPILED_FIX = ("run this plan without compile=True (an eager program issues its collectives "
                "in the rewritten graph's order, the same on every rank) and report the model "
                "to autopar, which must make what reaches Inductor the same on every rank")
EAGER_FIX = "report the plan and model to autopar: its rewrite differs by rank"


def checked_backend(which: str, check: OrderCheck | None, options: dict) -> Callable:
    """A ``torch.compile`` backend: Inductor with ``options``, whose forward and backward
    code is checked (:meth:`OrderCheck.check`) as soon as it is generated (or loaded from
    Inductor's cache), before it first runs. ``check`` None: Inductor alone."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm, example_inputs, **kwargs):
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        source = getattr(compiled, "source_code", None)
        part = "backward" if kwargs.get("is_backward") else "forward"
        if source is None:
            raise CollectiveOrderError(f"{which} {part}: Inductor returned no generated code "
                                       f"to check ({type(compiled).__name__})")
        check.check(f"the {which} program's {part}", inductor_collectives(source, check.groups),
                    COMPILED_FIX)
        return compiled

    def backend(gm, example_inputs):
        if check is None:
            return compile_fx(gm, example_inputs, config_patches=options)
        # AOTAutograd's own cache would hand back compiled code without calling ``inner``
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=options)
    return backend


_made = itertools.count()    # order checks this process made: the same count on every rank


def order_check(comm, pipelined: bool) -> OrderCheck | None:
    """The :class:`OrderCheck` of this rank (``comm``: its communicator on the plan's whole
    mesh), or None where there is nothing to check with (simulated ranks, one process).
    Unpipelined, every rank runs the same programs: one check of all; pipelined, each
    stage's ranks (the ranks with the same coordinate on axis 0). Called on every rank, in
    the same order (each module's build), which numbers the checks alike."""
    mesh = getattr(comm, "mesh", None)
    if mesh is None or not dist.is_initialized() or dist.get_world_size() < 2 \
            or mesh.mesh.numel() != dist.get_world_size() or job_store() is None:
        return None       # (a mesh of part of the job: the other ranks would not make the check)
    groups = {}
    for a, g in enumerate(comm.groups):
        groups[g.group_name] = (comm.axis_names[a], tuple(comm.group_ranks[a]))
    ranks, key = mesh.mesh, f"autopar/order/{next(_made)}"
    timeout = getattr(comm, "timeout", None) or DEFAULT_TIMEOUT_S
    if pipelined:
        for p in range(ranks.shape[0]):
            members = sorted(ranks[p].flatten().tolist())
            if dist.get_rank() in members:
                return OrderCheck(members, groups, f"{key}/stage{p}", timeout)
    return OrderCheck(sorted(ranks.flatten().tolist()), groups, key, timeout)


def check_eager_programs(check: OrderCheck | None, comm, programs: dict) -> None:
    """Each eager program's collectives compared across the ranks (:meth:`OrderCheck.check`),
    in the programs' order."""
    if check is None:
        return
    by_axis = [(g.group_name, comm.axis_names[a], tuple(comm.group_ranks[a]))
               for a, g in enumerate(comm.groups)]
    for which, gm in programs.items():
        if isinstance(gm, torch.fx.GraphModule):
            check.check(f"the {which} program", graph_collectives(gm, by_axis), EAGER_FIX)
