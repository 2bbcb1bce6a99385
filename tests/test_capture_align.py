"""Every rank's graph in rank 0's order and names (``autopar.capture.align``).

torchrun starts each rank with its own hash seed, and Python code that iterates a set of
strings (transformers' masks per layer kind) then runs in another order on another rank:
the same computation captured as another graph, under other node names, which a plan made
on rank 0 does not fit. The ranks of the gloo test below run under different
``PYTHONHASHSEED``s and capture Llama 4 in different orders (the worker checks they did);
the plan must still train as one device does.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from autopar.capture import CaptureError, capture, fingerprint
from autopar.capture.align import align, layout

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]


class TwoMasks(torch.nn.Module):
    """Two independent values worked out in an order ``flip`` chooses, as a set's order
    would: ``zeros`` and ``zeros_1`` swap which shape they hold."""

    def __init__(self, flip: bool, width: int = 8):
        super().__init__()
        self.flip = flip
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        if self.flip:
            b = torch.zeros(x.shape[0], 1) + 2.0
            a = torch.zeros(1, x.shape[1]) + 1.0
        else:
            a = torch.zeros(1, x.shape[1]) + 1.0
            b = torch.zeros(x.shape[0], 1) + 2.0
        return (self.lin(x) * a + b).relu()


def _captured(flip: bool, rows: int = 4, width: int = 8):
    torch.manual_seed(0)
    x, y = torch.randn(rows, width), torch.randn(rows, width)
    return capture(TwoMasks(flip, width), (x,), lambda out, t: ((out - t) ** 2).mean(), y)


def test_a_graph_captured_in_another_order_takes_rank_0s_order_and_names():
    ref, cap = _captured(False), _captured(True)
    assert fingerprint(cap) != fingerprint(ref)
    before = {n.name: n.meta["val"].shape for n in cap.gm.graph.nodes if n.name.startswith("zeros")}
    torch.manual_seed(1)
    feed = [torch.randn(p.meta["val"].shape) for p in cap.gm.graph.nodes if p.op == "placeholder"]
    before_out = _first(cap.gm(*feed))
    align(cap, layout(ref))
    assert fingerprint(cap) == fingerprint(ref)
    assert [n.name for n in cap.gm.graph.nodes] == [n.name for n in ref.gm.graph.nodes]
    after = {n.name: n.meta["val"].shape for n in cap.gm.graph.nodes if n.name.startswith("zeros")}
    assert after != before and after == {n.name: n.meta["val"].shape for n in ref.gm.graph.nodes
                                         if n.name.startswith("zeros")}
    assert cap.node(cap.loss) is not None and all(cap.node(o) is not None for o in cap.output)
    # the moved graph computes what it did (and what rank 0's does), on the same values
    assert torch.equal(_first(cap.gm(*feed)), _first(ref.gm(*feed)))
    assert torch.equal(_first(cap.gm(*feed)), before_out)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def test_a_graph_that_differs_in_more_than_order_is_refused_by_name():
    ref, cap = _captured(False, width=8), _captured(True, width=6)
    with pytest.raises(CaptureError, match="rank 0's graph has node"):
        align(cap, layout(ref))


def test_llama4_under_two_hash_seeds_trains_as_one_device(tmp_path, monkeypatch):
    """Rank 0 under PYTHONHASHSEED=99, rank 1 under 0 (``hash_seed_worker.py``): their
    captures of Llama 4 differ (the worker gathers both fingerprints), and the free plan
    trains to one device's numbers (``sweep_cases.run_dist``). Then again with the seeds
    swapped, on the same capture cache: rank 0 now plans on the cached graph, which the
    first launch's rank 0 captured in its own order, and ``run_dist``'s second module,
    given that plan, captures the model afresh in the other order: the plan's graph is
    read back from the cache (``api._capture_the_plans_graph``)."""
    pytest.importorskip("transformers")
    from launch import torchrun_cases
    sys.path[:0] = [os.path.join(os.path.dirname(HERE), "benchmarks")]
    import sweep_cases as sc
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    case = sc.make_case("llama4", "free", 2, "mean", {}, gloo=True)
    for seeds in ("99,0", "0,99"):
        monkeypatch.setenv("AUTOPAR_TEST_HASH_SEEDS", seeds)
        got, failed = torchrun_cases("hash_seed_worker.py", 2, [{"id": case.id, **case.to_json()}],
                                     tmp_path / f"out{seeds}.json", timeout=400, case_timeout=240)
        r = got.get(case.id)
        assert r is not None and r.get("ok"), (seeds, r, failed)
        assert len(set(r["raw_fingerprints"])) == 2, r      # the two ranks did capture apart
        assert r["status"] == "pass", (seeds, r)
