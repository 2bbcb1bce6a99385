"""Faults injected into training on 2 gloo ranks (issue 43, item 3).

One torchrun launch of ``tests/faults_worker.py inproc`` (a tiny MLP, ZeRO-3 over data 2,
AdamW, one plan for every run) injects, one after the other: SIGTERM on one rank (a
checkpoint on the signal, then a resume), a NaN in one rank's gradient, the disk full while
saving, a corrupted, a missing and a truncated shard at load, a rank that stalls in a
collective, a rank out of memory, a rank whose checkpoint write stalls, and a rank that dies
half way through writing its shard. Each test reads that
launch's events. "The same numbers": fp32 losses equal bitwise to the run without a fault
(``plain``), from the resumed step on; the run without a fault equals one device.

``@pytest.mark.slow`` (about 3 minutes on a busy 2-core machine): the ``chain`` launch under
``torchrun --max-restarts 4`` kills rank 1 with SIGKILL in forward, backward, the optimizer
step and while writing a checkpoint, then the test sends SIGTERM to the torchrun agent;
a new launch resumes. Command::

    PYTHONPATH=$PWD python -m pytest -q -p no:cacheprovider tests/test_faults.py -m slow

Single process: the errors for a partial or damaged checkpoint directory, the checksums of
``import_state_dict``'s output, and the signal handler.
"""
from __future__ import annotations

import math
import os
import signal
import time

import pytest
import torch

import autopar
from autopar.checkpoint import import_state_dict, latest_checkpoint, read_model_state
from autopar.errors import CheckpointError
from autopar.ops import fault_notice
from autopar.ops.comm import CollectiveError, DistComm
from autopar.runtime.out_of_memory import RankOutOfMemoryError, reported_oom
from autopar.runtime.ckpt_files import CHECKSUMS, partial_or_missing
from faults_worker import (CHAIN_KILLS, LR, NAN_STEP, OOM_STEP, SAVE_TIMEOUT, SIGTERM_STEP,
                           STALL_TIMEOUT, STEPS, batch, events, example, run_chain, run_inproc)

TOL = 1e-4     # worst |got - one device| over the largest change of that weight (test_restart's)


@pytest.fixture(scope="module")
def inproc(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    rc, log, _ = run_inproc(str(root))
    assert rc == 0, log
    return root, events(str(root))


def _by(evs, case, **match):
    found = [e for e in evs if e.get("case") == case and all(e.get(k) == v for k, v in match.items())]
    assert found, (case, match, [e.get("case") for e in evs])
    return found


def _plain(evs) -> dict:
    return {int(k): v for k, v in _by(evs, "plain")[-1]["losses"].items()}


def _one_device(steps) -> dict:
    ex = example()
    model = ex.model
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for s in steps:
        x, y = batch(s)
        ex.loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return init, {k: v.detach() for k, v in model.state_dict().items()}


def _worst(got, ref, init) -> float:
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    return max(float((got[k] - ref[k]).abs().max()) / float((ref[k] - init[k]).abs().max()) for k in ref)


def test_the_run_without_a_fault_equals_one_device(inproc):
    root, evs = inproc
    got = torch.load(root / "plain_final.pt", weights_only=True)
    init, ref = _one_device(range(1, STEPS + 1))
    assert _worst(got, ref, init) < TOL


def test_sigterm_saves_a_checkpoint_at_the_step_every_rank_agrees_on(inproc):
    _, evs = inproc
    plain = _plain(evs)
    ranks = {e["rank"]: e for e in _by(evs, "sigterm")}
    assert ranks[1]["received"] == signal.SIGTERM and ranks[0]["received"] is None, ranks
    # rank 0 never got the signal, yet saved with rank 1 at the end of the same step
    assert {r["saved_step"] for r in ranks.values()} == {SIGTERM_STEP}, ranks
    assert ranks[0]["saved"] == ranks[1]["saved"] and ranks[0]["saved"].endswith(f"step-{SIGTERM_STEP:08d}")
    for r in ranks.values():
        assert {int(k): v for k, v in r["losses"].items()} == {s: plain[s] for s in range(1, SIGTERM_STEP + 1)}
    # resuming (other initial weights) gives the losses of the run without the signal, bitwise
    resumed = _by(evs, "sigterm_resume")[-1]
    assert resumed["from_step"] == SIGTERM_STEP
    assert {int(k): v for k, v in resumed["losses"].items()} == \
        {s: plain[s] for s in range(SIGTERM_STEP + 1, STEPS + 1)}


def test_nan_in_one_ranks_gradient_skips_the_step_on_every_rank(inproc):
    _, evs = inproc
    plain = _plain(evs)
    for r in _by(evs, "nan"):
        stepped = {int(k): v for k, v in r["stepped"].items()}
        assert stepped == {s: s != NAN_STEP for s in range(1, 6)}, r
        assert r["skips"] == [[1]], r           # reported: rank 1's gradients, one skip
        losses = {int(k): v for k, v in r["losses"].items()}
        assert all(math.isfinite(v) for v in losses.values()), r     # training went on
        assert all(losses[s] == plain[s] for s in range(1, NAN_STEP + 1)), r
        assert losses[NAN_STEP + 1] != plain[NAN_STEP + 1], r       # the step did not happen ...
        # ... exactly: the weights equal those of the run without that step's batch, bitwise
        assert r["diff_to_run_without_step"] == 0.0, r


def test_disk_full_while_saving_keeps_the_previous_checkpoint(inproc):
    _, evs = inproc
    for r in _by(evs, "enospc"):
        assert r["raised"] == "CheckpointError", r
        for part in ("step 6", "rank 1", "No space left on device", "previous checkpoint is kept",
                     "step-00000002"):
            assert part in r["error"], (part, r["error"])
        assert r["latest"] == "step-00000002" and r["listing"] == ["step-00000002"], r   # no .tmp left
        assert r["seconds"] < 10, r


@pytest.mark.parametrize("kind, words", [("corrupt", "is corrupted (CRC-32"), ("missing", "is missing"),
                                         ("truncated", "is truncated")])
def test_a_damaged_shard_is_refused_naming_the_file(inproc, kind, words):
    _, evs = inproc
    for r in _by(evs, kind):
        assert r["raised"] == "CheckpointError", r
        assert f"the shard file {r['file']!r} {words}" in r["error"], r["error"]
        assert "load an older checkpoint" in r["error"], r["error"]
    assert {r["extra"]["step"] for r in _by(evs, "intact")} == {2}


def test_a_stalled_rank_ends_in_a_collective_error_within_the_timeout(inproc):
    _, evs = inproc
    r = _by(evs, "stall", rank=0)[-1]
    assert r["raised"] == "CollectiveError" and r["timed_out"], r
    assert (r["op"], r["axis"], r["ranks"]) == ("all_gather", "data", [0, 1]), r
    assert "logs of ranks [1]" in r["error"] and "timeout=SECONDS" in r["error"], r["error"]
    assert 0.9 * STALL_TIMEOUT <= r["seconds"] < STALL_TIMEOUT + 5, r


def test_one_rank_out_of_memory_stops_every_rank_naming_it(inproc):
    _, evs = inproc
    plain = _plain(evs)
    oom, peer = _by(evs, "oom", rank=1)[-1], _by(evs, "oom", rank=0)[-1]
    # rank 1: its own allocator's error, named (the rank, the step, the fix)
    assert oom["raised"] == "RankOutOfMemoryError" and oom["oom_step"] == OOM_STEP, oom
    for part in (f"rank 1 ran out of memory on cpu in step {OOM_STEP} ", "(forward and backward)",
                 "can't allocate memory", "lower the batch", "memory_budget=", "zero=3"):
        assert part in oom["error"], (part, oom["error"])
    # rank 0 stopped waiting long before its timeout (60 s): rank 1 posted its error
    assert peer["raised"] == "CollectiveError" and peer["step"] == OOM_STEP, peer
    assert peer["peer_fault"] == oom["error"] and peer["error"].startswith(oom["error"]), peer
    assert "rank 0 stopped waiting for" in peer["error"], peer["error"]
    injected = _by(evs, "oom_injected", rank=1)[-1]["injected_at"]
    assert 0 <= peer["raised_at"] - injected < 10, (peer, injected)
    for r in (oom, peer):      # the steps before it as without a fault; nothing written since
        assert {int(k): v for k, v in r["losses"].items()} == {s: plain[s] for s in range(1, OOM_STEP)}
        assert r["latest"] == "step-00000002" and r["listing"] == ["step-00000002"], r
    for r in _by(evs, "oom_resume"):        # resumed from it: the run without the fault's losses
        assert r["from_step"] == 2, r
        assert {int(k): v for k, v in r["losses"].items()} == {s: plain[s] for s in (3, 4, 5)}, r


def test_a_stalled_checkpoint_write_ends_in_an_error_naming_the_rank(inproc, tmp_path):
    _, evs = inproc
    r = _by(evs, "save_stall", rank=0)[-1]
    assert r["raised"] == "CheckpointError" and r["ranks"] == [1], r
    for part in ("step 4", ".step-00000004.tmp", "rank(s) [1] did not finish writing",
                 f"timeout={SAVE_TIMEOUT:g} s", "previous checkpoint is kept", "step-00000002"):
        assert part in r["error"], (part, r["error"])
    assert 0.9 * SAVE_TIMEOUT <= r["seconds"] < SAVE_TIMEOUT + 5, r
    assert r["latest"] == "step-00000002" and "step-00000004" not in r["listing"], r
    loads = _by(evs, "save_stall_load")
    assert {e["rank"] for e in loads} == {0, 1} and all(e["extra"] == {"step": 2} for e in loads), loads
    assert all(e["raised"] == "CheckpointError" for e in loads), loads    # the stalled rank too
    # a timeout that is not a number of seconds: refused before any collective
    assert set(r["bad_timeouts"]) == {"0", "-1", "True", "'10'", "inf", "nan"}, r["bad_timeouts"]
    for bad, error in r["bad_timeouts"].items():
        assert error.startswith(f"ArgumentError: timeout={bad}: pass how many seconds"), error


def test_a_rank_dying_while_writing_leaves_a_partial_checkpoint_that_is_never_loaded(inproc):
    _, evs = inproc
    assert _by(evs, "died_writing", rank=1)
    r = _by(evs, "died_writing", rank=0)[-1]
    assert r["raised"] == "CheckpointError" and "another rank stopped taking part" in r["error"], r
    assert "previous checkpoint is kept" in r["error"], r["error"]
    assert r["latest"] == "step-00000002" and ".step-00000008.tmp" in r["listing"], r
    assert "__1_0.distcp" in r["partial_files"] and ".metadata" not in r["partial_files"], r
    assert r["load_refused"] == "CheckpointError", r
    assert "save did not finish" in r["load_error"] and "step-00000002" in r["load_error"], r


# ---- one process ------------------------------------------------------------------------------
def test_partial_or_missing_directories(tmp_path):
    assert "is not a checkpoint directory" in str(partial_or_missing(str(tmp_path / "none")))
    part = tmp_path / ".step-00000004.tmp"
    part.mkdir()
    (part / "__0_0.distcp").write_bytes(b"x")
    err = partial_or_missing(str(part), latest_checkpoint)
    assert "save did not finish (1 shard files but no .metadata" in str(err)
    assert "load a complete checkpoint" in str(err)      # none complete yet
    (tmp_path / "step-00000002").mkdir()
    (tmp_path / "step-00000002" / ".metadata").write_bytes(b"")
    err = partial_or_missing(str(part), latest_checkpoint)
    assert repr(str(tmp_path / "step-00000002")) in str(err)
    with pytest.raises(CheckpointError, match="save did not finish"):
        read_model_state(part)


def test_checksums_of_an_imported_state_dict(tmp_path):
    sd = example().model.state_dict()
    import_state_dict(sd, tmp_path / "ck")
    assert (tmp_path / "ck" / CHECKSUMS).is_file()
    assert all(torch.equal(read_model_state(tmp_path / "ck")[k], v) for k, v in sd.items())
    f = tmp_path / "ck" / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01          # one bit
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="__0_0.distcp' is corrupted"):
        read_model_state(tmp_path / "ck")


def test_out_of_memory_is_named_posted_and_told_from_a_peers_report():
    class Comm:                  # what reported_oom reads of a communicator
        rank, device, posted = 1, torch.device("cpu"), []

        def post_fault(self, message):
            self.posted.append(message)
    comm = Comm()
    with pytest.raises(RankOutOfMemoryError) as got:
        with reported_oom(comm, 7, "forward"):
            torch.empty(2 ** 60, dtype=torch.uint8)       # the CPU allocator's real error
    assert isinstance(got.value, torch.cuda.OutOfMemoryError) and got.value.step == 7
    assert str(got.value).startswith("rank 1 ran out of memory on cpu in step 7 of its "
                                     "ParallelModule (forward): RuntimeError:"), got.value
    assert comm.posted == [str(got.value)]
    with pytest.raises(RankOutOfMemoryError, match=r"in step 9 .*\(the optimizer step\): "
                                                   r"OutOfMemoryError: CUDA out of memory"):
        with reported_oom(comm, 9, "the optimizer step"):      # the class CUDA's allocator raises
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    # a peer's error quoting the message is not this rank's own: passed on, not posted again
    with pytest.raises(CollectiveError):
        with reported_oom(comm, 8, "forward"):
            raise CollectiveError(str(got.value), op="all_gather", axis="data", ranks=[0, 1],
                                  timed_out=False, peer_fault=str(got.value))
    assert len(comm.posted) == 2


class _Pending:
    """A gloo work that never finishes: each timed wait times out (as c10d's ``Work.wait``)."""
    waits = 0

    def wait(self, timeout):
        self.waits += 1
        time.sleep(timeout.total_seconds())
        raise RuntimeError("Operation timed out!")

    def is_completed(self):
        return False


def _gloo_comm(timeout):
    comm = DistComm.__new__(DistComm)        # the wait only: no process group
    comm.rank, comm.timeout, comm._polls, comm.fault_key = 0, timeout, True, "autopar/fault/comm0"
    comm.axis_names, comm.group_ranks = ("data",), [[0, 1]]
    return comm


def test_a_wait_stops_at_a_peers_notice_or_at_its_timeout(monkeypatch):
    work, notice = _Pending(), "rank 1 ran out of memory on cpu in step 3 ..."
    monkeypatch.setattr(fault_notice, "posted", lambda key: notice if work.waits >= 2 else None)
    t0 = time.monotonic()
    with pytest.raises(CollectiveError) as e:
        _gloo_comm(None)._wait(work, "all_gather", 0)      # no timeout: only the notice ends it
    assert work.waits == 2 and time.monotonic() - t0 < 2 * fault_notice.POLL_S + 1
    assert e.value.peer_fault == notice and not e.value.timed_out, e.value
    assert str(e.value).startswith(notice + " (rank 0 stopped waiting for all_gather on mesh "
                                   "axis 'data', group ranks [0, 1], after"), e.value
    work = _Pending()
    monkeypatch.setattr(fault_notice, "posted", lambda key: None)
    t0 = time.monotonic()
    with pytest.raises(CollectiveError) as e:
        _gloo_comm(0.6)._wait(work, "all_gather", 0)       # no notice: the timeout ends it
    assert work.waits == 3 and 0.6 <= time.monotonic() - t0 < 2, work.waits
    assert e.value.timed_out and e.value.peer_fault is None and "timeout 0.6 s" in str(e.value)
    # a point-to-point wait is never cut in slices: gloo closes the pair when one expires
    work = _Pending()
    with pytest.raises(CollectiveError):
        _gloo_comm(0.6)._wait(work, "shift", 0)
    assert work.waits == 1


def test_preemption_records_the_signal_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    with autopar.Preemption() as p:
        assert not p.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert p.received == signal.SIGTERM and p.requested()
    assert signal.getsignal(signal.SIGTERM) is before
    with autopar.Preemption(every=3) as p:       # compares notes on every third call only
        os.kill(os.getpid(), signal.SIGTERM)
        assert [p.requested() for _ in range(6)] == [False, False, True, False, False, True]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(autopar.ArgumentError, match="every="):
            autopar.Preemption(every=bad)
    assert signal.getsignal(signal.SIGTERM) is before


# ---- the slow chain: SIGKILL in forward, backward, optimizer step, checkpoint; SIGTERM ---------
@pytest.mark.slow
def test_killed_ranks_and_a_preempted_job_resume_to_the_same_losses(tmp_path):
    out = run_chain(str(tmp_path))
    evs = events(str(tmp_path))
    assert out["sigterm_sent"] is not None, out["chain_log"]
    assert out["resume_rc"] == 0, out["resume_log"]
    plain = _plain(evs)
    for attempt, where in CHAIN_KILLS.items():
        assert _by(evs, "kill", attempt=attempt, rank=1, where=where)
        # the survivor's error names what failed (or the launcher stopped it first)
        for r in [e for e in evs if e.get("case") == "survivor" and e["attempt"] == attempt]:
            assert r["raised"] in ("CollectiveError", "CheckpointError"), r
    starts = {e["attempt"]: e["resumed_from"] for e in _by(evs, "start", rank=0)}
    # the step-4 save was cut short by the kill of attempt 3: attempt 4 resumes from step 2
    assert starts == {0: 0, 1: 2, 2: 2, 3: 2, 4: 2}, starts
    partial = _by(evs, "partial_load", rank=0)[-1]
    assert partial["exists"] and partial["raised"] == "CheckpointError", partial
    assert "save did not finish" in partial["error"] and "step-00000002" in partial["error"], partial
    pre = {e["rank"]: e["step"] for e in _by(evs, "preempted")}
    assert set(pre) == {0, 1} and len(set(pre.values())) == 1, pre
    resumed = _by(evs, "resumed")[-1]
    assert resumed["from_step"] == pre[0], resumed
    # every step any attempt took, and the resumed run's, has the fault-free run's loss, bitwise
    for e in _by(evs, "step"):
        assert e["loss"] == plain[e["step"]], e
    assert {int(k): v for k, v in resumed["losses"].items()} == \
        {s: plain[s] for s in range(pre[0] + 1, STEPS + 1)}
    got = torch.load(tmp_path / "resumed_final.pt", weights_only=True)
    want = torch.load(tmp_path / "plain_final.pt", weights_only=True)
    assert all(torch.equal(got[k], want[k]) for k in want)


class _LateWork:
    """A gloo work whose peer arrives just as a timed wait runs out: that wait raises
    "Operation timed out!", the work is complete when asked, and an untimed wait returns
    (``failed``: it completed with an error, which every wait raises)."""

    def __init__(self, failed: bool = False):
        self.failed, self.waits = failed, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if self.failed:
            raise RuntimeError("Connection closed by peer")
        if timeout is not None:
            raise RuntimeError("Operation timed out!")

    def is_completed(self):
        return True


def test_a_collective_finishing_as_its_polled_wait_expires_is_not_a_failure(monkeypatch):
    """A polled gloo wait (``DistComm._wait_polling``) whose slice runs out as the peer
    arrives finds the work complete: it succeeded, and the step goes on. It was taken for
    a failure: test_titan's qwen3-data case (its peer compiling its first step for 17 s)
    stopped with "all_reduce ... did not finish within 0.3 s" in a full-suite run. A work
    that completed with an error still raises it."""
    monkeypatch.setattr(fault_notice, "posted", lambda key: None)
    work = _LateWork()
    _gloo_comm(None)._wait(work, "all_reduce", 0)
    assert len(work.waits) == 2 and work.waits[-1] is None, work.waits
    with pytest.raises(CollectiveError) as e:
        _gloo_comm(None)._wait(_LateWork(failed=True), "all_reduce", 0)
    assert "Connection closed by peer" in str(e.value) and not e.value.timed_out, e.value
