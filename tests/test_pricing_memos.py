"""The pipeline pricing's memos and array forms give what the plain loops give: the graph
facts ``analysis.stages`` keeps per graph (refreshed when the graph changes), and
``NodeCosts.rank_memory`` / ``state`` summed as arrays (the same floats, bit for bit, and the
same dict order)."""
import operator
import random

import numpy as np
import torch

from autopar.analysis.stages import chain, chain_index, crossing_bytes, free_nodes, loss_tail
from autopar.solver.pipeline_costs import NodeCosts, _held_terms


def _crossing_loop(cap, local_bytes):
    """``crossing_bytes`` as one walk of the graph (what it was before it kept its spans),
    leaving out the values every stage recomputes: those computed from buffers and
    constants alone (the captured graph's buffers are placeholders)."""
    units = chain(cap)
    L, pos, free, at = len(units), {u: i for i, u in enumerate(units)}, free_nodes(cap.gm.graph), \
        chain_index(cap, units)
    free = set(free) | set(cap.buffers)
    for n in cap.gm.graph.nodes:
        mutates = getattr(getattr(n.target, "_schema", None), "is_mutable", False)
        if n.op == "call_function" and not mutates and all(a.name in free for a in n.all_input_nodes):
            free.add(n.name)
    diff = [0.0] * (L + 2)
    for n in cap.gm.graph.nodes:
        if n.op != "call_function" or n.name in free:
            continue
        if n.target is operator.getitem:
            src = pos.get(n.args[0].name)
        elif isinstance(n.meta.get("val"), torch.Tensor):
            src = pos.get(n.name)
        else:
            continue
        if src is None:
            continue
        far = max([src] + [at.get(u.name, L - 1) for u in n.users
                           if not (u.op == "call_function" and u.target is operator.getitem)])
        if far > src:
            b = local_bytes(n)
            diff[src + 1] += b
            diff[far + 1] -= b
    out, acc = [], 0.0
    for i in range(L + 1):
        acc += diff[i]
        if 1 <= i <= L - 1:
            out.append(max(acc, 0.0))
    return out


def test_graph_facts_are_kept_per_graph_and_follow_its_changes():
    from conftest import meta_llama_capture
    cap = meta_llama_capture(n_layer=2, seq=8, vocab=64, hidden_dim=32)
    size = lambda n: float(n.meta["val"].numel() * n.meta["val"].element_size())   # noqa: E731
    units = chain(cap)
    assert crossing_bytes(cap, size) == _crossing_loop(cap, size)
    assert len(crossing_bytes(cap, size)) == len(units) - 1
    assert loss_tail(cap) and not loss_tail(cap) & set(units)
    # a new op reading an early value at the graph's end: a chain node more, and that value
    # now live across every later cut (the kept facts must not answer for the old graph)
    graph = cap.gm.graph
    early = next(n for n in graph.nodes if n.name in set(units[2:]) and isinstance(n.meta.get("val"), torch.Tensor)
                 and n.meta["val"].is_floating_point())
    before = crossing_bytes(cap, size)
    last = [n for n in graph.nodes if n.name in set(units)][-1]
    with graph.inserting_after(last):
        late = graph.call_function(torch.ops.aten.neg.default, (early,))
    late.meta["val"] = early.meta["val"]
    assert chain(cap) == units + [late.name]
    after = crossing_bytes(cap, size)
    assert after == _crossing_loop(cap, size)
    grown = [i for i in range(len(before)) if after[i] > before[i]]
    assert grown and len(after) == len(before) + 1, (before, after)


def _placeholders(rng: random.Random, L: int, trial: int):
    keys = ["params", "grads", "optimizer", "buffers", "inputs"]
    out = []
    for x in range(rng.randint(0, 30)):
        terms = {k: rng.random() * 10 ** rng.randint(0, 12) for k in rng.sample(keys, rng.randint(0, 5))}
        users = frozenset(rng.sample(range(L), rng.randint(0 if trial % 7 == 0 else 1, min(L, 4))))
        out.append((f"p{x}", terms, users))
    return out


def test_placeholder_sums_as_arrays_equal_the_loops_bit_for_bit():
    rng = random.Random(0)
    z = np.zeros(0)
    for trial in range(200):
        L = rng.randint(1, 40)
        ph = _placeholders(rng, L, trial)
        held = np.array([rng.random() < 0.4 for _ in range(L)])
        loop: dict = {}
        for _, terms, users in ph:
            if any(held[u] for u in users):
                for k, b in terms.items():
                    loop[k] = loop.get(k, 0.0) + b
        assert list(_held_terms(ph, held).items()) == list(loop.items())

        starts = None if trial % 2 else np.array(sorted({0, *rng.sample(range(L), rng.randint(0, L - 1))}))
        at = np.arange(L) if starts is None else starts
        state = np.zeros(len(at))
        for _, terms, users in ph:
            b = sum(v for k, v in terms.items() if k != "inputs")
            if b and users:
                for u in set(np.searchsorted(at, sorted(users), side="right") - 1):
                    state[u] += b
        nc = NodeCosts(units=[str(i) for i in range(L)], batch=1, compute=z, comm=z, sync=z,
                       activations=z, comm_by=[], sync_by=[], placeholders=ph, cross=z,
                       cross_tensors=z, cross_learned=z)
        assert nc.state(starts).tobytes() == state.tobytes()
