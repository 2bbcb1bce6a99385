"""Elastic training (issue 31, part 2): the job re-plans when its world changes.

One real elastic job: four single-process "nodes", each its own ``torchrun --nnodes 3:4
--nproc-per-node 1`` agent meeting in a c10d rendezvous (whose store this test hosts, so
that no node's loss takes it down), running ``tests/elastic_worker.py``:

- 4 ranks train (``elastic=True, data=4, accumulate=2, zero=3``, global batch 24) until one
  node's worker SIGKILLs its agent and itself before step 5: the node is lost;
- the three agents left meet again without it and go on from checkpoint 4 on 3 ranks
  (``data=3``, ``accumulate=4``: the same global batch, no larger a micro-batch per rank);
- the test starts a new agent; the rendezvous puts it on its wait list, the three agents
  stop their workers, and all four resume from the newest checkpoint on 4 ranks and finish.

The final weights equal 12 uninterrupted one-device AdamW steps over the same global
batches, parameter by parameter (``autopar.verify``'s relative weight error), and not a
run that lost the data position. Single process: the pins each world gets, the errors for
worlds that cannot hold the global batch or the pins, and the world-independent sampler.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.elastic import GlobalBatchSampler, elastic_pins, global_batch_rows
from autopar.errors import ArgumentError
from autopar.options import Options
from autopar.verify import WEIGHT_ATOL, WEIGHT_RTOL
from elastic_worker import BATCH, KILL_AT, LR, PAUSE_AT, PINS, STEPS, dataset, example
from launch import free_port
from restart_worker import events

HERE = os.path.dirname(os.path.abspath(__file__))
RDZV_CONF = ("join_timeout=90,last_call_timeout=2,close_timeout=10,keep_alive_interval=1,"
             "keep_alive_max_attempt=4,is_host=false")
DEADLINE_S = 200


def _agent(root, port: int, name: str, victim: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "3:4", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
           "--rdzv-conf", RDZV_CONF, "--max-restarts", "3", "--monitor-interval", "0.2",
           os.path.join(HERE, "elastic_worker.py"), str(root)]
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: each round's process group gets a fresh store
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "ELASTIC_VICTIM": "1" if victim else "0"}
    env.pop("AUTOPAR_COLLECTIVE_TIMEOUT", None)
    out = open(root / f"agent-{name}.log", "w")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def _wait(cond, procs, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        if all(p.poll() is not None for p in procs):
            return cond()
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic")
    port = free_port()
    # the rendezvous' store lives here: a lost node must not take it with it
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    t0 = time.monotonic()
    agents = {n: _agent(root, port, n, victim=(n == "d")) for n in "abcd"}

    def paused() -> bool:      # the 3 ranks left wait for a new node at step PAUSE_AT
        return any(e["event"] == "wait" and e["why"] == "grow" for e in events(str(root)))

    grown = _wait(paused, list(agents.values()), DEADLINE_S / 2)
    if grown:
        agents["e"] = _agent(root, port, "e")
    codes = {}
    for n, p in agents.items():
        try:
            codes[n] = p.wait(timeout=max(t0 + DEADLINE_S - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGTERM)       # the agent stops its worker
            try:
                codes[n] = f"timed out, then {p.wait(timeout=20)}"
            except subprocess.TimeoutExpired:
                p.kill()
                codes[n] = f"timed out, then {p.wait()}"
    wall = time.monotonic() - t0
    logs = "\n".join(f"--- agent {n} ({codes[n]}) ---\n" + "\n".join(
        x for x in (root / f"agent-{n}.log").read_text().splitlines() if "Warning" not in x)[-3000:]
        for n in agents)
    del store
    return SimpleNamespace(root=root, codes=codes, events=events(str(root)), logs=logs, grown=grown,
                           wall=wall)


def _train_one_device(steps: list[int]):
    ex, ds = example(), dataset()
    sampler = GlobalBatchSampler(len(ds), BATCH)
    model = ex.model
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for s in steps:
        x, y = ds[sampler.global_indices(s)]
        ex.loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return init, {k: v.detach() for k, v in model.state_dict().items()}


def _weight_err(got: dict, ref: dict, init: dict) -> tuple[float, str]:
    """The worst ``|w - w_ref| / (WEIGHT_RTOL |w_ref - w_init| + WEIGHT_ATOL sqrt(n))`` in
    units of WEIGHT_RTOL (autopar.verify's weight error): < 1 passes."""
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    errs = {}
    for k, w in ref.items():
        floor = WEIGHT_ATOL / WEIGHT_RTOL * math.sqrt(w.numel())
        moved = float((w - init[k]).double().norm())
        errs[k] = float((got[k] - w).double().norm()) / (moved + floor) / WEIGHT_RTOL
    k = max(errs, key=errs.get)
    return errs[k], k


def _starts(ev, world):
    return [e for e in ev if e["event"] == "start" and e["world"] == world]


def test_a_lost_node_and_a_new_one_keep_training_equal_to_one_device(run):
    assert run.grown, f"the job never reached step {PAUSE_AT} on 3 ranks\n{run.events}\n{run.logs}"
    assert all(run.codes[n] == 0 for n in "abce"), f"{run.codes}\n{run.logs}"
    assert run.codes["d"] == -signal.SIGKILL, run.codes     # the lost node
    ev = run.events
    kill = [e for e in ev if e["event"] == "kill"]
    assert len(kill) == 1 and kill[0]["world"] == 4 and kill[0]["before_step"] == KILL_AT, kill
    first, shrunk, grown = _starts(ev, 4)[:4], _starts(ev, 3), _starts(ev, 4)[4:]
    # 4 ranks from scratch; 3 ranks from checkpoint 4 (the newest before the kill) with more
    # accumulation; 4 ranks again from checkpoint 8 (the newest before the new node came)
    assert {(e["resumed_from"], e["data"], e["accumulate"]) for e in first} == {(0, 4, 2)}, first
    assert {(e["resumed_from"], e["data"], e["accumulate"]) for e in shrunk[:3]} == {(4, 3, 4)}, shrunk
    # (a new node that came after the last call of the round that followed meets the 3 again)
    assert len(shrunk) % 3 == 0 and all(e["resumed_from"] == 8 for e in shrunk[3:]), shrunk
    assert len(grown) == 4 and {(e["resumed_from"], e["data"], e["accumulate"])
                                for e in grown} == {(8, 4, 2)}, grown
    done = [e for e in ev if e["event"] == "done"]
    assert len(done) == 1 and done[0]["world"] == 4 and done[0]["steps"] == STEPS, done
    r0 = {w: next(e for e in starts if e["rank"] == 0) for w, starts in ((3, shrunk), (4, grown))}
    print(f"\nelastic job: {run.wall:.1f} s; re-plan / reload on 3 ranks "
          f"{r0[3]['plan_seconds']:.2f} / {r0[3]['reload_seconds']:.2f} s, back on 4 "
          f"{r0[4]['plan_seconds']:.2f} / {r0[4]['reload_seconds']:.2f} s")

    got = torch.load(run.root / "final.pt", weights_only=True)
    init, ref = _train_one_device(list(range(STEPS)))
    err, where = _weight_err(got, ref, init)
    assert err < 1, f"{where} is off by {err:.2f} x WEIGHT_RTOL of its change"
    # the comparison sees a lost data position (resuming at step 0 instead of 4)
    _, lost = _train_one_device(list(range(4)) + list(range(STEPS - 4)))
    wrong, _ = _weight_err(got, lost, init)
    assert wrong > 100, wrong


# ---- one process ------------------------------------------------------------------------

def _pins(world, batch=BATCH, **pins):
    opts, info = elastic_pins(Options.from_pins(pins or PINS), world, batch)
    return opts.get("data"), opts.get("accumulate"), info.rows_per_rank


def test_fewer_ranks_accumulate_more_and_keep_the_global_batch():
    assert _pins(4) == (4, 2, 3)
    assert _pins(3) == (3, 4, 2)          # no more than 3 rows a rank: 4 micro-batches of 6
    assert _pins(2) == (2, 4, 3)
    assert _pins(1) == (1, 8, 3)
    assert _pins(8) == (8, None, 3)       # more ranks: no accumulation left
    assert _pins(6, tensor=2, data=2) == (3, None, 8)     # data takes what tensor leaves
    assert _pins(3, pipeline=3, micro_batch_size=4) == (1, None, 4)   # 6 micro-batches of 4


def test_a_world_that_cannot_hold_the_global_batch_names_the_fix():
    with pytest.raises(ArgumentError, match=r"global batch of 24 rows does not split over the 5 data "
                                            r"ranks.*1, 2, 3, 4, 6, 8, 12, 24.*multiple of 5"):
        _pins(5)
    with pytest.raises(ArgumentError, match=r"tensor=2 need a multiple of 2 ranks, but this job has 3"):
        _pins(3, tensor=2)
    with pytest.raises(ArgumentError, match=r"data=5 x accumulate=1 does not split"):
        _pins(4, data=5)
    with pytest.raises(ArgumentError, match="no example input or target is a tensor"):
        global_batch_rows((3,), None)
    assert global_batch_rows((torch.zeros(7, 2),)) == 7


def test_elastic_arguments_are_checked():
    ex = example()
    three = SimpleNamespace(world=SimpleNamespace(world=3))     # a communicator of 3 ranks
    with pytest.raises(ArgumentError, match="global batch of 8 rows does not split over the 3"):
        autopar.parallelize(ex.model, (ex.inputs[0][:8],), ex.loss_fn, target=ex.target[:8], comm=three,
                            elastic=True, data=4)
    for kw, msg in ((dict(elastic="yes"), "pass True"),
                    (dict(elastic=True, mesh_shape=(2, 2)), "fixes the world size"),
                    (dict(elastic=True, plan="p.json"), "pass pins instead of plan=")):
        with pytest.raises(ArgumentError, match=msg):
            autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, **kw)


def test_the_global_batches_do_not_depend_on_the_world():
    n = 50
    one = GlobalBatchSampler(n, 12, steps=9)
    batches = list(one)
    assert len(batches) == 9 and all(len(b) == 12 for b in batches)
    assert len(set(sum(batches[:4], []))) == 48                # one epoch: no index twice
    assert batches[4] != batches[0]                            # the next epoch reshuffles
    for world in (2, 3, 4, 6):
        for start in (0, 5):
            parts = [list(GlobalBatchSampler(n, 12, r, world, start=start, steps=9))
                     for r in range(world)]
            assert [sum(p, []) for p in zip(*parts)] == batches[start:], (world, start)
    with pytest.raises(ArgumentError, match="does not split over 5"):
        GlobalBatchSampler(n, 12, 0, 5)
    with pytest.raises(ArgumentError, match="holds no global batch"):
        GlobalBatchSampler(5, 12)
