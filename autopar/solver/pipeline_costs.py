"""What each op node of the chain costs under an intra-stage plan: the pipeline planner's inputs.

The core solver prices a plan as a whole (``Solution.compute_s``, ``comm_s``, ``memory``);
a pipeline needs the same prices per node, so it can add them up per stage. For every
node of ``chain(cap)`` (the op nodes a cut may fall before), read from the
:class:`autopar.pricing.prices.PriceTable` the solver used (nothing is priced again: same
precision, recomputation, the cluster's links), without its per-stage factors:

- ``compute``: forward + backward seconds of one micro-batch (recomputed nodes pay their
  forward again);
- ``comm``: resharding into the node, once per micro-batch (tensor-parallel all-reduces,
  ZeRO-3 all-gathers, the loss ending replicated), a conversion several readers share
  (``PriceTable.shared``) on the first of them;
- ``sync``: the gradient reductions of the parameters it reads, once per **step** (the
  runtime accumulates gradients over micro-batches and reduces once);
- ``activations``: bytes it keeps for backward on the device, per micro-batch; a node of
  an offloaded layer (``offload_activations=``) keeps its saved bytes in host memory
  instead (``host_activations``), pays its copies' share not hidden on ``compute``
  (``pricing.activation_offload``, at the exposed share the flat price uses), and a rank
  holding one holds ``offload_bytes`` on the device once: the layers in flight in backward;
- ``cross``, ``cross_tensors``: bytes and tensors live across the cut before it (a
  pipeline sends each tensor as a message of its own);
- placeholders (parameters, buffers, inputs) with their bytes by term and the chain nodes
  that read them, so a stage holds exactly the parameters its nodes use (a tied weight
  is held by both of its stages);
- ``params``: which nodes read a parameter (a stage must hold one).

Repeated layers share one decision (``NodeVar.members``); every member gets the
decision's per-member price, and an edge shared by ``count`` graph edges is spread evenly
over the members of its consumer. ``sum(compute + comm + sync)`` equals the solver's
``compute_s + comm_s`` (checked by tests/test_pipeline_planning.py).
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field, replace

import numpy as np

from autopar.analysis.layers import recompute_nodes
from autopar.analysis.stages import chain, chain_index, crossing_bytes, parameter_positions
from autopar.capture import Captured
from autopar.capture.graph import op_names
from autopar.cost_models.comm import collective_time
from autopar.cost_models.host import node_dispatches
from autopar.ops.experts import EXPERTS_OP
from autopar.sharding.registry import input_placements, output_placements
from autopar.pricing.activation_offload import copy_s
from autopar.pricing.costing import COPY_OUT, INF, grad_partial_flags
from autopar.pricing.floors import floor_s, kernels as op_kernels
from autopar.pricing.prices import EdgePrice, PriceTable, price_table
from autopar.schedule import rank_stages
from autopar.solver.stage_tables import in_flight, receive_in_flight


@dataclass
class NodeCosts:
    units: list[str]
    """Chain node names (``autopar.analysis.stages.chain``)."""
    batch: int
    """Samples in the captured graph (its micro-batch size)."""
    compute: np.ndarray
    comm: np.ndarray
    sync: np.ndarray
    activations: np.ndarray
    comm_by: list[dict]
    """Per chain node: {"collective@axis": seconds per micro-batch}."""
    sync_by: list[dict]
    """Per chain node: {"collective@axis": seconds per step}."""
    placeholders: list[tuple[str, dict, frozenset]]
    """(name, {term: bytes}, chain indices of its users) of every parameter, buffer, input."""
    cross: np.ndarray
    """Bytes (per device) live across the cut before chain node i, i = 1 .. L-1."""
    cross_tensors: np.ndarray
    """Tensors live across the cut before chain node i, i = 1 .. L-1: the messages a
    micro-batch sends over it each way."""
    cross_learned: np.ndarray
    """Of those, the ones computed from a parameter: a cut none crosses leaves the stages
    before it without a backward (buffer slices, masks), which is no pipeline stage."""
    cross_grad: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Of ``cross``, the bytes (per device) of the values computed from a parameter: each has
    a gradient sent back over the cut, which the receiving stage holds a buffer for.
    Empty: the runtime's receive buffers are not counted (``rank_memory``)."""
    recompute_bytes: float = 0.0
    """The transient of rebuilding one recomputed layer in backward (held once)."""
    recomputed: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    """Chain nodes inside recomputed layers."""
    offload_bytes: float = 0.0
    """The offloaded layers' saved bytes back on the device at once in backward (the
    ``activation_offload.in_flight_layers`` layers: the one whose backward runs and, on a
    GPU, the one prefetched; held once by a rank holding an offloaded node)."""
    offloaded: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    """Chain nodes whose saved bytes go to host memory (``offload_activations=``)."""
    host_activations: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per chain node: bytes per micro-batch it keeps in host memory (offloaded)."""
    node_offloaded: frozenset = frozenset()
    """Graph nodes whose saved bytes go to host memory (``with_recompute`` leaves them)."""
    launch: float = 0.0
    """Seconds of fixed cost per kernel on the device (launch and fill)."""
    comm_latency: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per chain node: the latency (alpha) part of ``comm``."""
    fixed_comm: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per chain node: the part of ``comm`` that converts values not computed from the batch
    (ZeRO-3's gathers of parameters, a weight resharded): the same bytes whatever the
    micro-batch, paid once per micro-batch. Empty: none."""
    node_forward_fixed_comm: dict = field(default_factory=dict)
    """Graph node -> the part of ``node_forward_comm`` that is ``fixed_comm``."""
    node_forward: dict = field(default_factory=dict)
    """Graph node -> its forward seconds (what recomputing it costs)."""
    node_activations: dict = field(default_factory=dict)
    """Graph node -> bytes it keeps for backward when not recomputed."""
    node_forward_comm: dict = field(default_factory=dict)
    """Graph node -> seconds of the forward collectives into it (run again when it is)."""
    node_forward_comm_by: dict = field(default_factory=dict)
    """Graph node -> {(collective, mesh axis): seconds} of ``node_forward_comm`` (what a
    recomputation policy that saves some collectives and not others runs again)."""
    params: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per chain node: 1 where it reads a parameter, else 0 (``parameter_positions``): a
    stage none of whose nodes reads one holds no parameter. Empty: not known (every node
    counts as reading one)."""
    expert_a2a: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))
    """Per chain node: (forward, backward) seconds of one micro-batch of its experts op's own
    all-to-alls (``CostModel.node_comm``: dispatch and combine), part of ``compute``; a
    recomputed experts op pays its forward's again in backward. Empty: none."""
    expert_a2a_by: dict = field(default_factory=dict)
    """Chain node -> {"all_to_all@axis": seconds of one micro-batch, forward + backward} of
    ``expert_a2a`` (the communication table's rows)."""
    node_forward_a2a: dict = field(default_factory=dict)
    """Graph node -> the forward all-to-all seconds of ``expert_a2a`` (run again when it is
    recomputed)."""
    weight_floor: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per chain node: the seconds of ``compute`` a micro-batch takes at least however few
    its samples: its GEMMs' reads of their weights (``pricing.floors.floor_s``: forward and
    backward, a recomputed forward again), and the whole of an op not computed from the
    batch (a weight's cast). Priced per sample from a larger batch, DeepSeek-V3's experts
    on 64 data-parallel ranks at one sample each were 1.10 s against their own 2.54 s (2.04
    with their kernels, 2.69 with the floors too); the stage DP adds what the floor exceeds
    (``LayerCosts.time_floors``). Empty: none."""
    node_forward_floor: dict = field(default_factory=dict)
    """Graph node -> the forward's part of ``weight_floor`` (what recomputing it adds)."""
    kernels: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per chain node: the kernels a micro-batch of it launches, each paying ``launch``
    whatever its size (:meth:`fixed`): an experts op's one GEMM per local expert and weight
    stack, forward and twice backward (``pricing.floors.kernels``; DeepSeek-V3's 128 experts a
    rank, of two stacks each, launch 768 a layer, 1,024 recomputed), three for any other
    node. Empty: three each."""
    node_forward_kernels: dict = field(default_factory=dict)
    """Graph node -> the forward's part of ``kernels`` where it is not one (an experts op:
    what recomputing it launches again)."""
    host_calls: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per chain node: the ATen calls an eager program dispatches for one micro-batch of
    it, forward and backward, and the forward again where it is recomputed
    (``cost_models.host.node_dispatches`` of every captured node ``chain_index`` puts
    there). Empty: not counted."""

    def with_recompute(self, cap: Captured, layers) -> NodeCosts:
        """These prices with ``layers`` recomputed (priced from a plan without): their nodes
        run forward again in backward and keep nothing but what leaves the layer; one layer's
        activations are rebuilt at a time."""
        rec, kept = recompute_nodes(cap.gm, layers)
        where = chain_index(cap, self.units)
        compute, act, flag = self.compute.copy(), self.activations.copy(), self.recomputed.copy()
        comm = self.comm.copy()
        fixed_comm = self.fixed_comm.copy() if len(self.fixed_comm) else np.zeros(len(comm))
        calls = self.host_calls.copy() if len(self.host_calls) else self.host_calls
        floor = self.weight_floor.copy() if len(self.weight_floor) else self.weight_floor
        kernels = self.kernels.copy() if len(self.kernels) else self.kernels
        rebuilt = 0.0
        a2a = self.expert_a2a
        for name, i in where.items():      # graph order: sums that do not move with the hash seed
            if name not in rec or name in self.node_offloaded:    # (offloaded: not both)
                continue
            compute[i] += self.node_forward.get(name, 0.0)
            if len(floor):
                floor[i] += self.node_forward_floor.get(name, 0.0)
            if len(kernels):
                kernels[i] += self.node_forward_kernels.get(name, 0)
            if name in self.node_forward_a2a:
                a2a = a2a.copy() if a2a is self.expert_a2a else a2a
                a2a[i, 1] += self.node_forward_a2a[name]
            if len(calls):                 # its forward's calls again
                calls[i] += _dispatches(cap).get(name, (0.0, 0.0))[0]
            comm[i] += self.node_forward_comm.get(name, 0.0)
            fixed_comm[i] += self.node_forward_fixed_comm.get(name, 0.0)
            if name not in kept:
                a = self.node_activations.get(name, 0.0)
                act[i] -= a
                rebuilt += a
                flag[i] = True
        a2a_by = self.expert_a2a_by
        if a2a is not self.expert_a2a:     # the rows of a recomputed experts op, in proportion
            a2a_by = {c: {k: x * float(a2a[c].sum() / self.expert_a2a[c].sum()) for k, x in by.items()}
                      for c, by in a2a_by.items()}
        return replace(self, compute=compute, comm=comm, activations=np.maximum(act, 0.0), recomputed=flag,
                       host_calls=calls, fixed_comm=fixed_comm, expert_a2a=a2a, expert_a2a_by=a2a_by,
                       weight_floor=floor, kernels=kernels,
                       recompute_bytes=max(self.recompute_bytes, rebuilt / max(len(layers), 1)))

    @property
    def time(self) -> np.ndarray:
        """Seconds of one micro-batch per chain node (compute + its resharding)."""
        return self.compute + self.comm

    def fixed(self) -> np.ndarray:
        """The part of ``time`` that does not shrink with the micro-batch: kernel launch and
        fill (``kernels``: about three per op node, its forward and two backward; an experts
        op's per expert), the latency of
        its collectives, and the conversions of values not computed from the batch
        (``fixed_comm``: ZeRO-3's gathers, the same bytes for any micro-batch; priced per
        sample, a stage of 20 micro-batches under ZeRO-3 was predicted at a third of its
        planned step: DeepSeek-V3's p = 8, 31.5 s against 110 s)."""
        c = np.where(self.compute > 0, np.minimum(self.compute, self._kernel_s()), 0.0)
        fixed = self.comm_latency + self.fixed_comm if len(self.fixed_comm) else self.comm_latency
        return c + np.minimum(self.comm, fixed)

    def _kernel_s(self):
        """Per chain node, its kernels' launches (``kernels`` x ``launch``)."""
        return self.kernels * self.launch if len(self.kernels) else 3 * self.launch

    def time_floors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(chain node, per-sample seconds, floor seconds) of the chain nodes with a
        ``weight_floor``: the per-sample part of their ``compute`` (what :meth:`fixed` leaves
        of it, over the batch) and their floor, at most that part at this batch, so a
        micro-batch of the captured size costs what it did; None where none has one."""
        if not len(self.weight_floor) or not self.weight_floor.any():
            return None
        linear = self.compute - np.where(self.compute > 0, np.minimum(self.compute, self._kernel_s()), 0.0)
        nodes = np.flatnonzero(self.weight_floor > 0)
        return (nodes, linear[nodes] / self.batch,
                np.minimum(self.weight_floor[nodes], linear[nodes]))

    def state(self, starts=None) -> np.ndarray:
        """Bytes of parameters, gradients, optimizer state and buffers per unit (chain nodes
        ``starts[u] .. starts[u+1] - 1``; default one unit per node): each is counted in
        every unit that reads it (a tied weight in both of its stages)."""
        starts = np.arange(len(self.units)) if starts is None else np.asarray(starts)
        out = np.zeros(len(starts))
        t = _terms(self.placeholders)
        if len(t.users):
            # each placeholder's bytes once into every unit one of its users is in, added
            # placeholder by placeholder (``add.at`` adds in the order given: the loop's sums)
            unit = np.searchsorted(starts, t.users, side="right") - 1
            owner = np.repeat(np.arange(len(t.starts)), np.diff(np.append(t.starts, len(t.users))))
            first = np.ones(len(unit), bool)
            pair = owner * (len(starts) + 1) + unit
            order = np.lexsort((unit, owner))
            first[order[1:]] = pair[order[1:]] != pair[order[:-1]]
            keep = first & (t.state[owner] != 0)
            np.add.at(out, unit[keep], t.state[owner[keep]])
        return out

    def rank_memory(self, stages: list[tuple[int, int]], in_flight: np.ndarray,
                    receive: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, float]:
        """Bytes per device by term of a rank holding chain nodes ``[j, i)`` of each of
        ``stages``, with ``in_flight[k]`` micro-batches of activations in stage k; with
        ``receive`` (per stage, the micro-batches of received values and of gradients sent
        back whose buffers it holds at its peak: ``stage_tables.receive_in_flight``) and
        ``cross_grad`` known, the runtime's receive buffers (``"pipeline_buffers"``: the
        values crossing its first cut, the gradients crossing its last; ``stage_dp``)."""
        held = np.zeros(len(self.units), bool)
        act = buffers = 0.0
        L = len(self.units)
        values, grads = receive if receive is not None else ((), ())
        for k, ((j, i), n) in enumerate(zip(stages, in_flight)):
            held[j:i] = True
            act += float(n) * float(self.activations[j:i].sum())
            if receive is not None and len(self.cross_grad):
                buffers += ((float(values[k]) * float(self.cross[j - 1]) if j > 0 else 0.0)
                            + (float(grads[k]) * float(self.cross_grad[i - 1]) if i < L else 0.0))
        out = _held_terms(self.placeholders, held)
        out["activations"] = act
        if buffers:
            out["pipeline_buffers"] = buffers
        if self.recompute_bytes and bool((held & self.recomputed).any()):
            out["recompute"] = self.recompute_bytes
        if self.offload_bytes and bool((held & self.offloaded).any()):
            out["offload"] = self.offload_bytes
        return out

    def rank_memories(self, stages: list[tuple[int, int]], schedule: str, p: int, m: int,
                      v: int) -> list[dict[str, float]]:
        """:meth:`rank_memory` of every pipeline rank, stage k on chain nodes ``stages[k]``,
        under ``schedule`` (p ranks, m micro-batches, v stages a rank)."""
        held = in_flight(schedule, p, m, v)
        values, grads = receive_in_flight(schedule, p, m, v)
        return [self.rank_memory([stages[k] for k in ks], held[ks], (values[ks], grads[ks]))
                for ks in rank_stages(schedule, p, v)]

    def rank_host_memory(self, stages: list[tuple[int, int]], in_flight: np.ndarray) -> float:
        """Bytes of host memory a rank holding chain nodes ``[j, i)`` of each of ``stages``
        keeps for the offloaded layers, ``in_flight[k]`` micro-batches of stage k's at once."""
        if not len(self.host_activations):
            return 0.0
        return float(sum(float(n) * float(self.host_activations[j:i].sum())
                         for (j, i), n in zip(stages, in_flight)))


class _Terms:
    """A placeholder list as arrays: its users flat (``users``, each placeholder's from
    ``starts``), its terms' bytes (``bytes_``: placeholder x term, 0 where it has none) and
    where each term stands in each placeholder's dict (``rank``: its insertion order)."""

    def __init__(self, placeholders):
        keys: dict[str, int] = {}
        for _, terms, _ in placeholders:
            for k in terms:
                keys.setdefault(k, len(keys))
        self.keys = list(keys)
        n = len(placeholders)
        self.bytes_ = np.zeros((n, len(keys)))
        self.has = np.zeros((n, len(keys)), bool)
        self.rank = np.zeros((n, len(keys)), int)
        users, self.starts = [], np.zeros(n, int)
        for x, (_, terms, us) in enumerate(placeholders):
            for r, (k, b) in enumerate(terms.items()):
                self.bytes_[x, keys[k]], self.has[x, keys[k]], self.rank[x, keys[k]] = b, True, r
            self.starts[x] = len(users)
            users.extend(us)
        self.users = np.asarray(users, int)
        self.empty = np.diff(np.append(self.starts, len(users))) == 0
        # bytes of state (all but the inputs), summed in each dict's order as ``state`` did
        self.state = np.array([sum(v for k, v in terms.items() if k != "inputs")
                               for _, terms, _ in placeholders], dtype=float)


_TERMS: dict = {}


def _terms(placeholders) -> _Terms:
    """``placeholders``' :class:`_Terms`, kept for the last few lists asked (a NodeCosts
    and its ``with_recompute`` copies share one)."""
    hit = _TERMS.get(id(placeholders))
    if hit is None or hit[0] is not placeholders:
        if len(_TERMS) >= 8:
            _TERMS.pop(next(iter(_TERMS)))
        hit = _TERMS[id(placeholders)] = (placeholders, _Terms(placeholders))
    return hit[1]


def _held_terms(placeholders, held: np.ndarray) -> dict[str, float]:
    """{term: bytes} of the placeholders any of whose users ``held`` marks: each term summed
    in placeholder order, the terms in the order a dict filled placeholder by placeholder
    has them (the same floats as that loop: ``add.accumulate`` adds one at a time)."""
    t = _terms(placeholders)
    if t.empty.any():          # (reduceat needs every placeholder to have a user)
        out: dict[str, float] = {}
        for _, terms, users in placeholders:
            if any(held[u] for u in users):
                for k, b in terms.items():
                    out[k] = out.get(k, 0.0) + b
        return out
    used = np.logical_or.reduceat(held[t.users], t.starts)
    mask = t.has & used[:, None]
    out: dict[str, float] = {}
    firsts = []
    for c, k in enumerate(t.keys):
        rows = np.flatnonzero(mask[:, c])
        if len(rows):
            firsts.append((int(rows[0]), int(t.rank[rows[0], c]), k,
                           float(np.add.accumulate(t.bytes_[rows, c])[-1])))
    for _, _, k, b in sorted(firsts):
        out[k] = b
    return out


def node_costs(cap: Captured, solved, local_bytes, axes=None) -> NodeCosts:
    """Per chain node prices of ``solved`` (a ``Solved``: problem, cost model, choice) on
    ``cap``, read from the :class:`PriceTable` the solver used; ``local_bytes(node)`` is a
    value's bytes per device (for the cut crossings), ``axes`` the mesh axis names the
    collectives are reported by. The per-node view: no per-stage memory factors, gradient
    reductions at their per-step price."""
    pt = price_table(solved.problem, solved.cost)
    units = chain(cap)
    acc = _Acc(cap, pt, solved.choice, units, axes)
    acc.nodes()
    acc.edges()
    acc.sink()
    cross = np.array(crossing_bytes(cap, local_bytes), dtype=float)
    learned = _from_parameters(cap)
    cross_grad = np.array(crossing_bytes(cap, lambda n: local_bytes(n) if n.name in learned else 0.0),
                          dtype=float)
    tensors, from_params = _crossings(cap)
    batch = int(cap.node(cap.inputs[0]).meta["val"].shape[0]) if cap.inputs else 1
    dev = pt.cost.cluster.device
    params = np.zeros(len(units))
    params[list(parameter_positions(cap))] = 1.0
    return NodeCosts(units=units, batch=batch, compute=acc.compute, comm=acc.comm, sync=acc.sync,
                     activations=acc.act, comm_by=acc.comm_by, sync_by=acc.sync_by,
                     placeholders=acc.placeholders, cross=cross, cross_tensors=tensors,
                     cross_learned=from_params, cross_grad=cross_grad,
                     recompute_bytes=acc.rec_bytes,
                     recomputed=acc.recomputed, comm_latency=acc.alpha, fixed_comm=acc.fixed,
                     node_forward_fixed_comm=acc.node_fwd_fixed,
                     offload_bytes=acc.off_bytes, offloaded=acc.offloaded, host_activations=acc.host,
                     node_offloaded=frozenset(acc.node_off),
                     launch=float(dev.launch_overhead + dev.fill_time), node_forward=acc.node_forward,
                     node_activations=acc.node_act, node_forward_comm=acc.node_fwd_comm,
                     node_forward_comm_by=acc.node_fwd_comm_by,
                     expert_a2a=acc.a2a, node_forward_a2a=acc.node_a2a, expert_a2a_by=acc.a2a_by,
                     params=params, host_calls=host_calls(cap, units, solved.cost.recompute),
                     weight_floor=acc.floor, node_forward_floor=acc.node_floor,
                     kernels=acc.kernels if acc.node_kernels else np.zeros(0),
                     node_forward_kernels=acc.node_kernels)


def host_calls(cap: Captured, units: list[str], recomputed=frozenset()) -> np.ndarray:
    """ATen calls of one micro-batch per chain node (``NodeCosts.host_calls``): each
    captured node's forward and backward calls (``cost_models.host``) on the chain node
    whose stage runs it (``chain_index``), its forward's again if it is in ``recomputed``."""
    out = np.zeros(len(units))
    dispatches = _dispatches(cap)
    for name, i in chain_index(cap, units).items():
        f, b = dispatches.get(name, (0.0, 0.0))
        out[i] += f + b + (f if name in recomputed else 0.0)
    return out


def _once_per_graph(fn):
    """``fn(cap)`` worked out once per captured graph alive (keyed by its GraphModule: the
    free search prices many plans of one graph, and a captured graph is not rewritten)."""
    memo: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    @functools.wraps(fn)
    def once(cap: Captured):
        got = memo.get(cap.gm)
        if got is None:
            got = memo[cap.gm] = fn(cap)
        return got
    return once


@_once_per_graph
def _dispatches(cap: Captured) -> dict[str, tuple[float, float]]:
    """Per call_function node: its (forward, backward) ATen calls (``node_dispatches``)."""
    return {n: node_dispatches(op) for n, op in op_names(cap.gm).items()}


@_once_per_graph
def _crossing_counts(cap: Captured) -> tuple[np.ndarray, np.ndarray]:
    learned = _from_parameters(cap)
    return (np.array(crossing_bytes(cap, lambda n: 1.0), dtype=float),
            np.array(crossing_bytes(cap, lambda n: float(n.name in learned)), dtype=float))


def _crossings(cap: Captured) -> tuple[np.ndarray, np.ndarray]:
    """(tensors, tensors computed from a parameter) crossing each cut: the same under every
    plan (copies of the graph's own)."""
    tensors, learned = _crossing_counts(cap)
    return tensors.copy(), learned.copy()


def _reached_from(cap: Captured, seeds) -> set[str]:
    """``seeds`` and every node computed from one of them (directly or through others)."""
    out = set(seeds)
    for n in cap.gm.graph.nodes:
        if any(a.name in out for a in n.all_input_nodes):
            out.add(n.name)
    return out


@_once_per_graph
def _not_from_batch(cap: Captured) -> frozenset[str]:
    """Nodes not computed from the model's inputs (parameters, buffers and what is computed
    from them alone): their sizes do not change with the micro-batch."""
    return frozenset(n.name for n in cap.gm.graph.nodes) - _reached_from(cap, cap.inputs)


@_once_per_graph
def _from_parameters(cap: Captured) -> frozenset[str]:
    """Nodes computed from a parameter (directly or through other nodes)."""
    return frozenset(_reached_from(cap, cap.params))


class _Acc:
    """``node_costs``' running sums, per chain node."""

    def __init__(self, cap: Captured, pt: PriceTable, choice: dict, units: list[str], axes):
        self.cap, self.pt, self.choice = cap, pt, choice
        L = len(units)
        self.L, self.where = L, chain_index(cap, units)
        self.compute, self.comm, self.sync, self.act, self.alpha, self.fixed = (np.zeros(L) for _ in range(6))
        self.batch_free = _not_from_batch(cap)      # their conversions: fixed per micro-batch
        # op -> its inputs (``call.inputs`` indices) not computed from the batch: its weights
        fixed_inputs: dict[str, set[int]] = {}
        for e in pt.problem.edges:
            if e.src in self.batch_free:
                fixed_inputs.setdefault(e.dst, set()).add(e.dst_in)
        self.fixed_inputs = {k: tuple(sorted(x)) for k, x in fixed_inputs.items()}
        self.node_fwd_fixed: dict = {}
        self.comm_by = [{} for _ in range(L)]
        self.sync_by = [{} for _ in range(L)]
        self.recomputed = np.zeros(L, bool)
        self.offloaded, self.host = np.zeros(L, bool), np.zeros(L)
        self.off_bytes, self.node_off = 0.0, []
        mesh = pt.problem.mesh_shape
        self.names = list(axes) if axes else [f"axis{a}" for a in range(len(mesh))]
        self.placeholders: list = []
        self.node_forward, self.node_act, self.node_fwd_comm = {}, {}, {}
        self.node_fwd_comm_by: dict = {}
        self.a2a, self.node_a2a, self.a2a_by = np.zeros((L, 2)), {}, {}   # experts ops' all-to-alls
        self.floor, self.node_floor = np.zeros(L), {}    # ``NodeCosts.weight_floor``
        self.kernels, self.node_kernels = np.full(L, 3.0), {}      # ``NodeCosts.kernels``
        self.rec_bytes = 0.0
        self._latency: dict = {}      # (collective, axis) -> ``latency``, asked per edge

    def latency(self, k) -> float:     # one collective of kind k[0] on axis k[1], no bytes
        if k[0] == COPY_OUT:
            return 0.0                # a copy on the device: no link, no latency
        got = self._latency.get(k)
        if got is None:
            got = self._latency[k] = collective_time(k[0], 1.0, self.pt.problem.mesh_shape[k[1]],
                                                     self.pt.cost.links[k[1]])
        return got

    def add(self, by: dict, k, s: float):
        key = f"{k[0]}@{self.names[k[1]]}"
        by[key] = by.get(key, 0.0) + s

    def nodes(self):
        """Compute and bytes of every decision's chosen option, per member."""
        pt, cost, problem = self.pt, self.pt.cost, self.pt.problem
        for name, v in problem.vars.items():
            i = self.choice[name]
            price = pt.option(name, i)
            if v.kind != "op":
                for member in v.members:
                    users = frozenset(self.where[u.name] for u in self.cap.node(member).users
                                      if u.name in self.where)
                    self.placeholders.append((member, dict(price.memory), users or frozenset([0])))
                continue
            f, b = price.forward_s, price.backward_s
            mem = price.memory.get("activations", 0.0)
            # the seconds of a call that do not shrink with its batch: the whole of an op
            # not computed from it, else its weights' reads (forward once, backward twice)
            if name in self.batch_free:
                floor_f, floor = f, f + b
            else:
                floor_f, floor_b = floor_s(cost, v, v.options[i], self.fixed_inputs.get(name, ()))
                floor = floor_f + floor_b
            kernels = op_kernels(cost, v, v.options[i]) if v.call.op is EXPERTS_OP else None
            # its own all-to-alls (an experts op's dispatch and combine), inside f and b
            own = cost.node_comm(v, v.options[i])
            a2a = (sum(t[0] for t in own.values()), sum(t[1] for t in own.values()))
            # the solver's "recompute" term: one layer's activations, rebuilt in backward;
            # its "offload" term: the offloaded layers' back on the device in backward
            split = pt.memory(name, i, weighted=False)
            self.rec_bytes += split.get("recompute", 0.0)
            self.off_bytes += split.get("offload", 0.0)
            for member in v.members:
                c = self.where.get(member)
                if c is None:
                    continue
                rec = member in cost.recompute
                off = member in cost.act_offload and member not in cost.act_offload_kept
                self.node_forward[member], self.node_act[member] = f, mem
                self.compute[c] += f + b + (f if rec else 0.0)
                if floor:
                    self.floor[c] += floor + (floor_f if rec else 0.0)
                    self.node_floor[member] = floor_f
                if kernels is not None:     # an experts op's, in place of three
                    self.kernels[c] += kernels[0] + kernels[1] - 3 + (kernels[0] if rec else 0)
                    self.node_kernels[member] = kernels[0]
                if a2a[0] or a2a[1]:
                    self.a2a[c] += (a2a[0], a2a[1] + (a2a[0] if rec else 0.0))
                    self.node_a2a[member] = a2a[0]
                    by = self.a2a_by.setdefault(c, {})
                    for k, (fa, ba) in own.items():
                        self.add(by, k, fa + ba + (fa if rec else 0.0))
                # a recomputed view keeps nothing either (a reshape that copies, such as
                # repeat_kv's, may be saved: autopar.analysis.saved)
                if rec and member not in cost.recompute_kept:
                    self.recomputed[c] = True
                elif off:          # to the host and back, the share not hidden on the step
                    self.offloaded[c] = True
                    self.host[c] += mem
                    self.node_off.append(member)
                    self.compute[c] += cost.act_offload_exposed * copy_s(mem, cost.cluster.device)
                else:
                    self.act[c] += mem

    def edges(self):
        """Resharding into each node, spread over the consumer's members; a parameter's
        gradient reductions as ``sync``."""
        problem, choice = self.pt.problem, self.choice
        shared, paid = self.pt.shared(), set()
        for k, e in enumerate(problem.edges):
            u, v = problem.vars[e.src], problem.vars[e.dst]
            cu, cv = u.options[choice[e.src]], v.options[choice[e.dst]]
            pair = (output_placements(cu, e.src_out), input_placements(cv, e.dst_in),
                    grad_partial_flags(cv, e.dst_in))
            price = self.pt.edge(k, *pair)
            t, _ = price.priced()
            members = [m for m in v.members if m in self.where]
            if t == INF or t == 0 or not members:
                continue
            if k in shared:      # a conversion its group shares: on its first reader only
                if (shared[k], pair) in paid:
                    continue
                paid.add((shared[k], pair))
            share = e.count / len(members)
            fixed = e.src in self.batch_free
            comm, sync = price.split()
            # some of the consumer's members recomputed (a partial recompute list): the
            # price's rerun is their share; each member pays its own forward again or not
            each = {r: replace(price, rerun=r).split()[0] for r in (0.0, 1.0)} \
                if 0.0 < price.rerun < 1.0 else None
            for m in members:
                if each is not None:
                    comm = each[1.0 if m in self.pt.cost.recompute else 0.0]
                # its forward collectives, which run again if the consumer is recomputed
                self.node_fwd_comm[m] = self.node_fwd_comm.get(m, 0.0) + price.forward_s * share
                if fixed:
                    self.node_fwd_fixed[m] = self.node_fwd_fixed.get(m, 0.0) + price.forward_s * share
                for step in price.steps or ():
                    f = EdgePrice((step,)).forward_s
                    if f:
                        self.add(self.node_fwd_comm_by.setdefault(m, {}), (step.kind, step.axis),
                                 f * share)
                c = self.where[m]
                for key, s in sync.items():
                    self.sync[c] += s * share
                    self.add(self.sync_by[c], key, s * share)
                for key, s in comm.items():
                    self.comm[c] += s * share
                    if fixed:
                        self.fixed[c] += s * share
                    else:
                        self.alpha[c] += min(s, self.latency(key)) * share
                    self.add(self.comm_by[c], key, s * share)

    def sink(self):
        """The loss ending replicated, on the last chain node."""
        problem = self.pt.problem
        if not problem.sink:
            return
        name = problem.sink[0]
        t, by = self.pt.sink(name, self.choice[name]).priced()
        if t in (0, INF):
            return
        self.comm[self.L - 1] += t
        for key, s in by.items():
            self.alpha[self.L - 1] += min(s, self.latency(key))
            self.add(self.comm_by[self.L - 1], key, s)
