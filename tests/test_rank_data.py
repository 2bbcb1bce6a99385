"""Per-rank data (``autopar.parallelize(..., batch="per_rank")``), on real gloo ranks: each
rank passes the slice a ``DistributedSampler(num_replicas=pm.data_world, rank=pm.data_rank)``
gives it; the run equals one device on the concatenated batch (forward outputs, the loss of
3 SGD steps, every gradient, the weights after the steps), for a mean and a padded
(``ignore_index``) loss, on data 2 (2 ranks), data 2 x tensor 2 and pipeline 2 x data 2
(4 ranks; ``tests/rank_data_worker.py``, one torchrun launch per world size).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from launch import torchrun_cases

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HERE = os.path.dirname(os.path.abspath(__file__))

CASES = [  # (id, ranks, pins, data_world)
    ("data2", 2, {"data": 2}, 2),
    ("dp2xtp2", 4, {"data": 2, "tensor": 2}, 2),
    ("pp2xdp2", 4, {"pipeline": 2, "micro_batch_size": 2, "data": 2, "schedule": "1f1b"}, 2),
]
LOSSES = ("mean", "ignore")
MATRIX = [(f"{loss}-{cid}", n, pins, w, loss) for cid, n, pins, w in CASES for loss in LOSSES]


def _torchrun(nproc: int, cases: list[dict], tmp) -> tuple[dict, str]:
    return torchrun_cases("rank_data_worker.py", nproc, cases, tmp / f"rank_data_{nproc}.json",
                          timeout=600, case_timeout=120)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    done: dict[int, tuple[dict, str]] = {}

    def get(nproc: int):
        if nproc not in done:
            cases = [{"id": cid, "loss": loss, "pins": pins, "data_world": w}
                     for cid, n, pins, w, loss in MATRIX if n == nproc]
            done[nproc] = _torchrun(nproc, cases, tmp_path_factory.mktemp(f"rank_data{nproc}"))
        return done[nproc]
    return get


@pytest.mark.parametrize("cid,nproc,pins,data_world,loss", MATRIX, ids=[m[0] for m in MATRIX])
def test_per_rank_slices_equal_one_device(launch, cid, nproc, pins, data_world, loss):
    results, failed = launch(nproc)
    r = results.get(cid)
    assert r is not None, f"{cid}: no result, the launch ended before it\n{failed}"
    assert r["ok"], f"{cid}: {r['error']}\n{r.get('trace', '')}"
    assert r["data_world"] == data_world
    # ranks with the same data coordinate share a data rank; data ranks cover 0..w-1
    axis = r["axes"].index("data")
    by_coord = {tuple(c)[axis]: d for c, d in r["data_ranks"]}
    assert all(by_coord[tuple(c)[axis]] == d for c, d in r["data_ranks"])
    assert sorted(by_coord.values()) == list(range(data_world))
    print(f"{cid}: forward {r['forward']:.1e} loss {r['worst']['loss']:.1e} grad "
          f"{r['worst']['grad']:.1e} weight {r['worst']['weight']:.1e} ({r['seconds']:.1f}s)")


# ---- the data axes of a plan, one process ---------------------------------------------------
def test_data_axes_of_plans():
    """The ``data`` axis when the plan names one; in a free plan, the axes every batched
    input and the target are split on along dim 0; none for a tensor-only plan."""
    from dataclasses import replace
    from types import SimpleNamespace

    import autopar
    from autopar.capture import capture
    from autopar.runtime.data import RankData, data_axes
    from loss_worker import example

    model, inputs, target, loss_fn = example("mean")
    cap = capture(model, inputs, loss_fn, target=target)
    dp = autopar.plan(model, inputs, loss_fn, target=target, cluster="cpu:4", data=2, tensor=2)
    assert dp.mesh_axes == ("data", "tensor") and data_axes(dp, cap) == (0,)
    free = replace(dp, mesh_axes=("axis0", "axis1"))       # same placements, unnamed axes
    assert data_axes(free, cap) == (0,)
    tp = autopar.plan(model, inputs, loss_fn, target=target, cluster="cpu:2", tensor=2)
    assert tp.mesh_axes == ("tensor",) and data_axes(tp, cap) == ()
    # data rank from the coordinate; tensor peers share it; "global" is one data rank
    for coord, want in (((0, 0), 0), ((0, 1), 0), ((1, 0), 1), ((1, 1), 1)):
        rd = RankData(dp, cap, SimpleNamespace(coord=coord), "per_rank")
        assert (rd.rank, rd.world) == (want, 2)
        assert rd.slice(inputs[0]).shape[0] == inputs[0].shape[0] // 2
    rd = RankData(dp, cap, SimpleNamespace(coord=(1, 1)), "global")
    assert (rd.rank, rd.world) == (0, 1)
    with pytest.raises(ValueError, match="per_rank"):
        RankData(dp, cap, SimpleNamespace(coord=(0, 0)), "sliced")


def test_train_gpt_example_from_a_dataloader():
    """``examples/train_gpt.py`` on 2 gloo ranks, data 2: each rank reads its DataLoader
    slice; every step's loss equals the one-device model's on the concatenated slices."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = os.path.join(os.path.dirname(HERE), "examples", "train_gpt.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port), script,
           "--pin", "data=2", "--steps", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "batch=per_rank: data world 2, 4 windows per data rank" in proc.stdout, proc.stdout[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines()
            if len(line.split()) == 3 and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3], proc.stdout[-2000:]
    for _, got, ref in rows:
        assert abs(float(got) - float(ref)) <= 1e-5 * abs(float(ref)), rows
