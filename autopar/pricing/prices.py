"""Every price of a sharding problem, computed once per (problem, cost model).

The ILP (``autopar.solver.ilp``), the stage DP's per-node costs
(``autopar.solver.pipeline_costs``), ``explain`` (``autopar.viz.explain``) and the plan's
estimate all read one :class:`PriceTable`, so the figure any of them shows for an option
is the figure that entered the plan:

- per decision variable and option, an :class:`OptionPrice` (:meth:`PriceTable.option`):
  forward and backward seconds and bytes by term of one member, as the cost model prices
  them before recomputation and the pipeline's per-stage factors, each priced on first
  read (the compute floor reads the seconds alone, the memory floor the bytes alone, the
  program both: once); :meth:`PriceTable.time`, :meth:`PriceTable.compute_s` and
  :meth:`PriceTable.memory` give the solver's view (recomputation, ``memory_weights``);
- per edge and (producer placement, consumer placement), an :class:`EdgePrice`: its
  collectives by (collective, axis), each priced once; :meth:`EdgePrice.priced` applies
  the gradient-sync factor (the solver's ``grad_sync_scale``, or 1 for the per-step view);
- which nodes follow their producer (Alpa's "follow" merging) and which option they take
  for each of the producer's, so every reader prices a follower's input edge alike;
- which edges share one conversion (:meth:`PriceTable.shared`): readers of one value that
  need it in the same placement convert it once (``passes.insert_collectives``), so such
  a conversion is paid once by all of them.

:func:`price_table` returns the table of a cost model, building it on first use: the ILP
and every later reader of the same ``(problem, cost)`` (``Solved``) share one.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from autopar.analysis.layers import offload_nodes, recompute_nodes, select_layers
from autopar.capture import Captured
from autopar.cost_models.hardware import parse_cluster
from autopar.errors import ArgumentError
from autopar.mesh_roles import MeshRoles
from autopar.placement import Replicate
from autopar.plan import Plan
from autopar.sharding.registry import input_placements, output_placements
from autopar.pricing.fp8 import fp8_gather_edges, fp8_nodes
from autopar.pricing.costing import (INF, Collective, CostModel, Saves, StepView, grad_partial_flags,
                                     hidden_steps_s, params_read, price_steps)
from autopar.cost_models.compute import FUSABLE
from autopar.cost_models.families import VIEW, family
from autopar.options import OPTIMIZER_STATES
from autopar.pricing.problem import VIEW_OPS, Problem, build_problem, is_unary_elementwise


@dataclass(frozen=True)
class OptionPrice:
    """One option of one decision, for one of its members (repeated-layer copies)."""
    forward_s: float
    backward_s: float            # without recomputation
    memory: dict                 # bytes per device by term, before recomputation and weights


@dataclass(frozen=True)
class EdgePrice:
    """One redistribution of an edge: its collectives (None: not offered), the number of
    graph edges that share it, and how often the consumer's forward runs again."""
    steps: tuple[Collective, ...] | None
    count: int = 1
    rerun: float = 0.0

    def priced(self, sync_scale: float = 1.0) -> tuple[float, dict]:
        """(seconds, seconds by (collective, axis)) of all ``count`` edges; INF when not offered."""
        t, by = price_steps(self.steps, self.rerun, sync_scale)
        return (t * self.count if t != INF else INF), {k: s * self.count for k, s in by.items()}

    def hidden(self, sync_scale: float = 1.0) -> float:
        """Seconds of :meth:`priced` that may overlap compute (``Collective.overlap``)."""
        return hidden_steps_s(self.steps, self.rerun, sync_scale) * self.count

    def split(self) -> tuple[dict, dict]:
        """({(collective, axis): s} per micro-batch, {...: s} gradient reductions per step)
        of one of the ``count`` edges, the reductions at their full (per-step) price."""
        comm, sync = {}, {}
        for c in self.steps or ():
            t, _ = price_steps((c,), self.rerun)
            by = sync if c.sync else comm
            by[(c.kind, c.axis)] = by.get((c.kind, c.axis), 0.0) + t
        return comm, sync

    @property
    def forward_s(self) -> float:
        """Seconds of one run of one edge's forward collectives (what recomputation repeats)."""
        return price_steps(self.steps, 1.0)[0] - price_steps(self.steps, 0.0)[0] if self.steps else 0.0


def followers(problem: Problem) -> dict[str, str]:
    """Follower -> producer: a view or an elementwise op with one tensor input takes the
    placement its producer gives it (Alpa's "follow" merging), so it needs no variable."""
    incoming: dict[str, list] = defaultdict(list)
    for e in problem.edges:
        incoming[e.dst].append(e)
    out = {}
    for name, v in problem.vars.items():
        if v.kind != "op" or len(v.call.inputs) != 1 or len(incoming[name]) != 1:
            continue
        e = incoming[name][0]
        if e.src == name or not (v.call.op in VIEW_OPS or is_unary_elementwise(v.call.op)):
            continue
        out[name] = e.src
    return out


def fused_reads(problem: Problem) -> dict[str, frozenset[int]]:
    """Under ``compile=True``: for each op that Inductor fuses (``cost_models.compute.FUSABLE``),
    the indices of its tensor inputs whose producer, looked through views, is fusable too:
    read inside the fused kernel (``cost_models.compute``'s docstring)."""
    incoming: dict[str, list] = defaultdict(list)
    for e in problem.edges:
        incoming[e.dst].append(e)

    def fam(name):
        v = problem.vars[name]
        return family(v.call.op) if v.kind == "op" else None

    def source(name):       # through single-input views to the op that made the tensor
        seen = 0
        while fam(name) == VIEW and len(incoming[name]) == 1 and seen < 64:
            name, seen = incoming[name][0].src, seen + 1
        return name
    out = {}
    for name, v in problem.vars.items():
        if v.kind != "op" or fam(name) not in FUSABLE:
            continue
        reads = frozenset(e.dst_in for e in incoming[name]
                          if e.src != name and fam(source(e.src)) in FUSABLE)
        if reads:
            out[name] = reads
    return out


class PriceTable:
    """The prices of ``problem``'s options and edges under ``cost`` (module docstring)."""

    def __init__(self, problem: Problem, cost: CostModel):
        self.problem, self.cost = problem, cost
        if cost.offload:       # ZeRO-Offload: the copies' share not hidden (cost_models.offload)
            cost.offload_exposed = cost.offload_share(problem)
        if cost.fp8:           # the ops precision="fp8" runs in fp8 (autopar.pricing.fp8)
            cost.fp8_nodes = fp8_nodes(problem, cost.options)
        self.fp8_edges = fp8_gather_edges(problem, cost)     # weights gathered in fp8
        if cost.act_offload:   # offloaded activations: the copies' share not hidden
            cost.act_offload_exposed = cost.act_offload_share(problem)
        if cost.compiled:      # Inductor's fused memory-bound ops (cost_models.compute)
            cost.fused_reads = fused_reads(problem)
        # each option's seconds and bytes, priced on first read (the compute floor reads no
        # bytes, the memory floor no seconds; the program reads both, once)
        self._base_times: dict = {}      # (name, option) -> cost.base_time
        self._base_memory: dict = {}     # (name, option) -> cost.base_memory
        self._reads = params_read(problem)
        self._edges: dict = {}
        self._times: dict = {}       # (name, option) -> time(): read per edge pair by the ILP
        self._reruns: dict = {}      # consumer -> cost.rerun(): one sum over members per node
        self._shared: dict[int, int] | None = None
        # pair prices keyed by numbers (:meth:`number`, :meth:`signature`, :meth:`pair`):
        # edges of one shape, recomputation and kind price their pairs of classes alike,
        # and numbers hash far cheaper than the placement tuples they name
        self._numbers: dict = {}     # class -> its number
        self._classes: list = []     # number -> class
        self._sigs: dict = {}        # (shape, dtype, needs_grad, bucketed, shared, count, rerun) -> number
        self._sig_args: list = []    # number -> (an edge index, bucketed, shared)
        self._pairs: dict = {}       # (signature, p, q) -> (EdgePrice, priced, hidden)
        self._follow: dict[str, tuple[str, list[int]]] | None = None
        self._picks: dict = {}       # (signature, options' (class, compute)) -> {class: pick}
        self._pick_orders: dict = {} # options' (class, compute) -> indices by (compute, index)

    @property
    def follow(self) -> dict[str, tuple[str, list[int]]]:
        """Follower -> (root, its option for each of the root's options). Worked out on
        first use: each follower's pick prices its input edge under every pair of
        placements (most of a table's cost: 50 of 54 s on a Mixtral 8x7B stage mesh), which
        the node prices (``compute_floor``) do not read."""
        if self._follow is None:
            self._follow = {}
            problem = self.problem
            producer = followers(problem)
            into = {e.dst: k for k, e in enumerate(problem.edges) if e.dst in producer}
            for name in problem.vars:   # graph order: a producer is settled before its followers
                if name in producer:
                    pick = self._pick(into[name])
                    if pick is not None:
                        self._follow[name] = (self.root(problem.edges[into[name]].src), pick)
        return self._follow

    # ---- nodes ---------------------------------------------------------------------------
    def option(self, name: str, i: int) -> OptionPrice:
        """Option ``i`` of ``name`` as the cost model prices one member, before recomputation
        and weights."""
        return OptionPrice(*self._base_time(name, i), self._base_bytes(name, i))

    def _base_time(self, name: str, i: int) -> tuple[float, float]:
        return self._once(self._base_times, self.cost.base_time, name, i)

    def _base_bytes(self, name: str, i: int) -> dict:
        return self._once(self._base_memory, self.cost.base_memory, name, i)

    def _once(self, memo: dict, price, name: str, i: int):
        """``price(node, option i, optimizer states)`` of ``name``, kept in ``memo``."""
        got = memo.get((name, i))
        if got is None:
            v = self.problem.vars[name]
            got = memo[(name, i)] = price(v, v.options[i], self.problem.optimizer_states)
        return got

    def time(self, name: str, i: int) -> tuple[float, float]:
        """(forward, backward) seconds of one member under option ``i``, recomputation included."""
        got = self._times.get((name, i))
        if got is None:
            # (the bytes only where offloaded activations' copies add to backward)
            memory = self._base_bytes(name, i) if self.cost.act_offload else None
            got = self._times[(name, i)] = self.cost.with_recompute(self.problem.vars[name],
                                                                    self._base_time(name, i), memory)
        return got

    def self_comm(self, name: str, i: int) -> dict:
        """Seconds by ``(collective, axis)`` of all members of ``name`` under option ``i``
        that :meth:`compute_s` holds (``CostModel.node_comm``: an experts op's all-to-alls),
        recomputation included as :meth:`time` includes it: the estimate shows them as
        communication, not compute."""
        v = self.problem.vars[name]
        out = {}
        for key, (f, b) in self.cost.node_comm(v, v.options[i]).items():
            f, b = self.cost.with_recompute(v, (f, b))
            out[key] = len(v.members) * (f + b)
        return out

    def compute_s(self, name: str, i: int) -> float:
        """Forward + backward seconds of all members of ``name`` under option ``i``."""
        f, b = self.time(name, i)
        return len(self.problem.vars[name].members) * (f + b)

    def memory(self, name: str, i: int, weighted: bool = True) -> dict[str, float]:
        """Bytes per device by term of all members under option ``i``, recomputation split
        out; ``weighted``: times the cost model's ``memory_weights`` (the solver's view)."""
        v = self.problem.vars[name]
        terms = self.cost.split_recompute(v, self._base_bytes(name, i))
        terms = self.cost.weigh(terms) if weighted else terms
        return {k: len(v.members) * b for k, b in terms.items()}

    # ---- edges ---------------------------------------------------------------------------
    def root(self, name: str) -> str:
        """The decision that settles ``name``: its own, or the one it follows."""
        return self.follow[name][0] if name in self.follow else name

    def option_of(self, name: str, i: int) -> int:
        """Option of ``name`` when its root runs option ``i``."""
        return self.follow[name][1][i] if name in self.follow else i

    def edge(self, k: int, src, dst, grad_partial) -> EdgePrice:
        """Edge ``problem.edges[k]`` carrying producer placement ``src`` into consumer
        placement ``dst`` (whose gradient comes back partial on ``grad_partial``)."""
        e = self.problem.edges[k]
        if e.dst in self.follow:       # a follower's input: priced as in the merge
            return self._edge(k, src, dst, grad_partial, False, 1)
        return self._edge(k, src, dst, grad_partial, self.problem.vars[e.src].kind == "param",
                          self._reads.get(e.dst, 1))

    def shared(self) -> dict[int, int]:
        """Edge index -> the index of the first edge of its group, for the edges whose
        conversions are shared: the ones that read one value (``src``, ``src_out``) and that
        the same graph edges and recomputation repeat (equal ``count`` and consumer
        ``rerun``), so one conversion a member serves every reader that needs the same
        (placement, partial-gradient flags), as the rewrite runs it. Each group's price
        per such class is any member's :meth:`edge` (the same value, count and rerun). Left
        out, each paying its own as before: a parameter's edges (not shared at run time),
        a follower's input (priced into its root's option) and an edge whose ends one
        decision settles (priced into that decision's cost). Only groups of two or more."""
        if self._shared is None:
            groups: dict[tuple, list[int]] = defaultdict(list)
            for k, e in enumerate(self.problem.edges):
                if (e.dst in self.follow or self.problem.vars[e.src].kind == "param"
                        or self.root(e.src) == self.root(e.dst)):
                    continue
                groups[(e.src, e.src_out, e.count, e.needs_grad, self._rerun(e.dst))].append(k)
            self._shared = {k: ks[0] for ks in groups.values() if len(ks) > 1 for k in ks}
        return self._shared

    def _rerun(self, name: str) -> float:
        rerun = self._reruns.get(name)
        if rerun is None:
            rerun = self._reruns[name] = self.cost.rerun(self.problem.vars[name])
        return rerun

    def sink(self, name: str, i: int) -> EdgePrice:
        """The loss (output ``problem.sink``) ending replicated, from option ``i`` of its node."""
        n = len(self.problem.mesh_shape)
        v, out = self.problem.vars[name], self.problem.sink[1]
        key = ("sink", output_placements(v.options[i], out))
        if key not in self._edges:
            self._edges[key] = EdgePrice(self.cost.edge_steps(v.outputs[out], key[1], (Replicate(),) * n,
                                                              (False,) * n))
        return self._edges[key]

    def _edge(self, k, src, dst, grad_partial, bucketed, shared) -> EdgePrice:
        if not self.problem.edges[k].needs_grad:     # no gradient comes back: nothing to reduce
            grad_partial = (False,) * len(grad_partial)
        # no memo of its own: an edge's pair is priced about once per table (4% hits on
        # GPT-175B), and its key hashed the placements twice more; the cost model's memo
        # (``edge_steps``) is the one that hits
        e = self.problem.edges[k]
        return EdgePrice(self.cost.edge_steps(e.meta, src, dst, grad_partial, bucketed, shared,
                                              k in self.fp8_edges),
                         e.count, self._rerun(e.dst))

    # ---- pairs by number -------------------------------------------------------------
    def number(self, cls) -> int:
        """The number of a class (a producer's output placements, or a consumer's (input
        placements, partial-gradient flags)), the same for equal classes in this table."""
        n = self._numbers.get(cls)
        if n is None:
            n = self._numbers[cls] = len(self._classes)
            self._classes.append(cls)
        return n

    def signature(self, k: int, follower: bool | None = None) -> int:
        """A number for what :meth:`edge`'s price of edge ``k`` reads besides its pair of
        classes: the tensor, whether a gradient comes back, the bucketing and sharing of a
        parameter's edge, the graph edges it stands for and the consumer's rerun. Edges of
        one signature price each pair of classes alike. ``follower``: priced as a
        follower's input (default: whether its consumer follows)."""
        e = self.problem.edges[k]
        if follower is None:
            follower = e.dst in self.follow
        if follower:
            bucketed, shared = False, 1
        else:
            bucketed = self.problem.vars[e.src].kind == "param"
            shared = self._reads.get(e.dst, 1) if bucketed else 1   # edge_steps reads it only then
        key = (e.meta.shape, e.meta.dtype, e.needs_grad, bucketed, shared, e.count, self._rerun(e.dst),
               k in self.fp8_edges)
        n = self._sigs.get(key)
        if n is None:
            n = self._sigs[key] = len(self._sig_args)
            self._sig_args.append((k, bucketed, shared))
        return n

    def pair(self, sig: int, p: int, q: int) -> tuple[EdgePrice, tuple[float, dict], float]:
        """(:meth:`edge`, its ``priced``, its ``hidden`` at the cost model's
        ``grad_sync_scale``) of producer class number ``p`` into consumer class number ``q``
        on an edge of signature ``sig``; priced once per table. The ``by`` dicts are shared:
        read them, do not change them."""
        key = (sig, p, q)
        got = self._pairs.get(key)
        if got is None:
            k, bucketed, shared = self._sig_args[sig]
            dst, partial = self._classes[q]
            price = self._edge(k, self._classes[p], dst, partial, bucketed, shared)
            scale = self.cost.grad_sync_scale
            got = self._pairs[key] = (price, price.priced(scale), price.hidden(scale))
            if got[1][0] < 0:   # what _best_input's early stop and compute_floor rest on
                raise RuntimeError(f"edge {self.problem.edges[k].src} -> {self.problem.edges[k].dst}: "
                                   f"a conversion priced {got[1][0]!r} s (< 0): the cost model's "
                                   "collective times must be >= 0")
        return got

    def _pick(self, k: int) -> list[int] | None:
        """A follower's cheapest option (input edge + compute) for each of its root's
        options, the first in option order among equals; None when some root option leaves
        it none. The pick depends on the producer's class only, so it is worked out once per
        class (:meth:`_best_input`), and shared by followers of one signature with the same
        options' classes and compute."""
        e = self.problem.edges[k]
        u, v = self.problem.vars[e.src], self.problem.vars[e.dst]
        sig = self.signature(k, follower=True)
        ins = tuple((self.number((input_placements(c, 0), grad_partial_flags(c, 0))), self.compute_s(e.dst, j))
                    for j, c in enumerate(v.options))
        taking: dict = {}            # input placements -> the options that take them
        for j, c in enumerate(v.options):
            taking.setdefault(input_placements(c, 0), []).append(j)
        key = (sig, ins)
        by_class = self._picks.get(key)
        if by_class is None:
            by_class = self._picks[key] = {}
        order = self._pick_orders.get(ins) if PRUNE_PICKS else range(len(ins))
        if order is None:        # options by compute, then index: the scan's order
            order = self._pick_orders[ins] = sorted(range(len(ins)), key=lambda j: (ins[j][1], j))
        by_placement: dict = {}      # placement -> class number, once per placement
        pick = []
        for i in range(len(self.problem.vars[self.root(e.src)].options)):
            p = output_placements(u.options[self.option_of(e.src, i)], e.src_out)
            pn = by_placement.get(p)
            if pn is None:
                pn = by_placement[p] = self.number(p)
            if pn not in by_class:
                first = taking.get(p, ()) if PRUNE_PICKS else ()
                by_class[pn] = self._best_input(sig, pn, ins, (*first, *order))
            if by_class[pn] is None:
                return None
            pick.append(by_class[pn])
        return pick

    def _best_input(self, sig: int, pn: int, ins: tuple, order) -> int | None:
        """The option ``j`` of least ``pair(sig, pn, q_j) + compute_j`` over ``ins`` (each
        option's (class number, compute seconds)), the least ``j`` among equals; None when
        every total is INF. ``order``: the options in the order they are tried.

        Under :data:`PRUNE_PICKS` the order is the options that take the producer's
        placement as it is (no conversion but a partial gradient's, so usually the cheapest
        total), then every option by (compute, index); an option whose compute alone is above
        the best total so far is skipped unpriced. Exact: every pair price is >= 0
        (:meth:`pair` checks it), so such an option's total is above the best so far, which
        only falls, and it is not picked; an option whose compute equals the best total is
        still priced (a free conversion would tie it, and the least index wins a tie,
        whatever the order tried), so the pick is the exhaustive scan's. An option tried
        twice is priced once (``pair``'s memo)."""
        best, best_cost = None, INF
        for j in order:
            q, compute = ins[j]
            if PRUNE_PICKS and (compute > best_cost or compute == INF):
                continue
            total = self.pair(sig, pn, q)[1][0] + compute
            if total < best_cost or (total == best_cost and total != INF and j < best):
                best, best_cost = j, total
        return best


PRUNE_PICKS = True
"""Whether :meth:`PriceTable._best_input` tries a follower's options in its pruning order and
skips the ones that cannot win (exact: the same picks, fewer conversions priced; measured
2026-11-29, ``PYTHONHASHSEED=0``: the tiny llama's 2 x 2 program 6,245 -> 5,941 of the
picks' pairs, the tiny Mixtral's 2 x 2 x 2 one 167,185 -> 153,948; ``tests/
test_ilp_reduction.py``). False: every option priced in index order, as before; a switch
for tests and measurement."""


def memory_floor(problem: Problem, cost: CostModel) -> float:
    """Bytes per device no plan of ``problem`` under ``cost`` stays below: the largest of
    the ILP's memory rows (one per phase of the step, ``CostModel.memory_phases``) with
    every decision at its least for that row. Memory adds up over decisions and no edge
    carries any, so a floor above the budget means the ILP is infeasible; it reads no
    time or edge price."""
    phases = cost.memory_phases
    grouped = {k for g in phases for k in g}
    floors = [0.0] * max(1, len(phases))
    pt = price_table(problem, cost)      # its bytes are the program's rows' (tabulate)
    for name, v in problem.vars.items():
        rows = [[0.0] * len(v.options) for _ in floors]
        for i in range(len(v.options)):
            terms = pt.memory(name, i)
            for r, group in enumerate(phases or ((),)):
                rows[r][i] = sum(b for k, b in terms.items() if k in group or k not in grouped)
        for r, row in enumerate(rows):
            floors[r] += min(row, default=0.0)
    return max(floors)


def compute_floor(problem: Problem, cost: CostModel) -> float:
    """Seconds no plan of ``problem`` under ``cost`` predicts less than (the ILP's objective,
    ``ilp.solve``): the sum over every node, followers included, of its least compute
    (forward + backward, recomputation included, times its members) over its options.

    Why it holds: a solution's objective is ``compute_s + Σ comm_s - overlapped_s``
    (``ilp._fill_breakdown``). ``compute_s`` is the sum of each node's compute at the
    option chosen, so at least the sum of each node's least; every edge's, sink's and
    absorbed edge's price is >= 0; ``overlapped_s`` = pool - ``exposed_sync``(pool, ...)
    where the pool is the overlappable part of those same prices and ``exposed_sync`` is
    >= 0, so ``Σ comm_s - overlapped_s`` >= ``Σ comm_s - pool`` >= 0. An option priced
    ``INF`` the ILP never chooses; a node whose every option is ``INF`` gives ``INF``.
    Reads no edge price (it builds the node prices the ILP reads anyway)."""
    pt = price_table(problem, cost)
    return sum(min(pt.compute_s(name, i) for i in range(len(v.options)))
               for name, v in problem.vars.items() if v.options)


def price_table(problem: Problem, cost: CostModel) -> PriceTable:
    """``cost``'s table for ``problem``, built on first use and kept on ``cost``."""
    table = getattr(cost, "_prices", None)
    if table is None or table.problem is not problem:
        table = cost._prices = PriceTable(problem, cost)
    return table


def plan_prices(cap: Captured, plan: Plan, optimizer: str = "adamw") -> PriceTable:
    """The price table ``plan`` was solved with, rebuilt from what the plan records: its
    mesh, cluster, pins (precision, ZeRO stage) and recomputed layers, through the same
    :meth:`CostModel.for_pins` and :func:`price_table` the solver uses."""
    if plan.pipeline_stages > 1:
        raise ArgumentError("explain prices one intra-stage plan; this is a pipeline plan "
                            f"({plan.pipeline_stages} stages): its per-stage prices are not rebuilt yet")
    if optimizer not in OPTIMIZER_STATES:
        raise ArgumentError(f"optimizer {optimizer!r} unknown; one of {sorted(OPTIMIZER_STATES)}")
    roles = MeshRoles.of_plan(plan)
    problem = build_problem(cap, tuple(plan.mesh_shape), roles, zero=plan.options.zero_stage,
                            optimizer_states=OPTIMIZER_STATES[optimizer])
    cost = CostModel.for_pins(parse_cluster(plan.cluster), tuple(plan.mesh_shape), plan.options,
                              data_axis=roles.data,
                              recompute=Saves(*recompute_nodes(cap.gm, plan.recompute),
                                              *offload_nodes(cap.gm, select_layers(
                                                  cap.gm, plan.options.offload_activations), cap.params)),
                              # gradient accumulation: one micro-batch's prices, its
                              # gradient sync a 1/k share (solver.accumulate)
                              view=StepView(grad_sync_scale=1.0 / plan.accumulate),
                              native=cap.native_dtypes)
    return price_table(problem, cost)
