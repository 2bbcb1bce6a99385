"""Faults injected into a real job on 2 gloo ranks (``tests/test_faults.py``,
``benchmarks/faults.py``).

``python faults_worker.py MODE ROOT`` under torchrun. Every run trains the tiny MLP
(``examples.small.mlp_factory``) under ZeRO-3 over data 2 on the global batches of
:func:`batch` (one per step, the same on every rank), with AdamW, under one plan (solved
once, saved to ``ROOT/plan.json``, loaded by every later run: the same plan, so the same
losses bitwise). Each event is one JSON line of ``ROOT/events.jsonl``.

``MODE`` ``inproc`` (one launch, no restart; the default test):

1. ``plain``: ``STEPS`` steps without a fault (the losses every other run is compared with);
   a checkpoint at step 2.
2. ``sigterm``: rank 1 gets SIGTERM during step 3; :class:`autopar.Preemption` makes both
   ranks save at the end of step 3; a new module resumes from it and trains to ``STEPS``.
3. ``nan``: rank 1's gradient gets a NaN in step 3; ``pm.step(opt, skip_nonfinite=True)``
   skips that step on both ranks; then a run on the batches without step 3's (``nan_ref``).
4. ``enospc``: rank 1's checkpoint writer raises ENOSPC (the disk full) while saving step 6.
5. ``corrupt``, ``missing``, ``truncated``: one shard file of the step-2 checkpoint damaged,
   then loaded.
6. ``stall``: rank 1 does not take part in a step; rank 0's has ``timeout=STALL_TIMEOUT``.
7. ``oom``: rank 1 runs out of memory (a real allocation too large for its device) in the
   forward of step ``OOM_STEP``; rank 0, waiting for it in a collective, stops with its
   error long before ``OOM_TIMEOUT``; a new module resumes from the last checkpoint.
8. ``save_stall``: rank 1's checkpoint writer stalls; rank 0's ``save_step_checkpoint(...,
   timeout=SAVE_TIMEOUT)`` raises naming it; the previous checkpoint loads.
9. ``died_writing``: rank 1 ends (``os._exit``) half way through writing its shard of a
   checkpoint; rank 0 sees the save fail. (Exit code 0, so that torchrun leaves rank 0 to
   report; ``chain`` kills with SIGKILL.)

``MODE`` ``chain`` (under ``torchrun --max-restarts 4``; ``@pytest.mark.slow``): each
attempt resumes from ``latest_checkpoint`` (a checkpoint every 2 steps) and rank 1 is
SIGKILLed: attempt 0 in the forward of step 3, 1 in its backward, 2 in its optimizer step,
3 while writing the step-4 checkpoint. Attempt 4 tries to load that partial checkpoint,
then trains slowly under :class:`autopar.Preemption` until the test sends SIGTERM to the
torchrun agent (as a scheduler preempting the job); the ranks save and exit. ``MODE``
``resume``: a new launch resumes from that checkpoint to ``STEPS``, then a run without any
fault (``plain``) for the comparison.
"""
from __future__ import annotations

import errno
import faulthandler
import io
import json
import os
import shutil
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_fs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autopar  # noqa: E402
from autopar.checkpoint import latest_checkpoint, save_step_checkpoint  # noqa: E402
from examples.small import mlp_factory  # noqa: E402

STEPS, EVERY, LR = 8, 2, 1e-2
PINS = {"data": 2, "zero": 3}
STALL_TIMEOUT = 1.0
OOM_STEP, OOM_TIMEOUT = 3, 60.0
SAVE_TIMEOUT = 2.0
NAN_STEP, SIGTERM_STEP = 3, 3
CHAIN_KILLS = {0: "forward", 1: "backward", 2: "optimizer", 3: "checkpoint"}
SLOW_STEP_S = 0.3        # attempt 4 of the chain: a step's time, so the SIGTERM lands mid-run


def example(seed: int = 0):
    return mlp_factory(batch=8, seed=seed)


def batch(step: int):
    """The global batch of step ``step`` (1-based): the same on every rank and in every run."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)


def log(root: str, **event) -> None:
    with open(os.path.join(root, "events.jsonl"), "a") as f:
        f.write(json.dumps({**event, "time": time.time()}) + "\n")


def events(root: str) -> list[dict]:
    path = os.path.join(root, "events.jsonl")
    return [json.loads(x) for x in open(path).read().splitlines()] if os.path.exists(path) else []


def build(root: str, seed: int = 0, **kw):
    """A ParallelModule of the MLP (weights of ``seed``) under the job's one plan, and AdamW."""
    ex = example(seed)
    plan_path = os.path.join(root, "plan.json")
    if os.path.exists(plan_path):
        pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, plan=plan_path, **kw)
    else:
        pm = autopar.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, **PINS, **kw)
        if dist.get_rank() == 0:
            pm.plan.save(plan_path)
        dist.barrier()
    return pm, torch.optim.AdamW(pm.parameters(), lr=LR)


def step(pm, opt, s: int, *, skip_nonfinite=False, before_step=None) -> tuple[float, bool]:
    x, y = batch(s)
    loss = pm.train_step(x, target=y)
    if before_step is not None:
        before_step()
    stepped = pm.step(opt, skip_nonfinite=skip_nonfinite)
    opt.zero_grad()
    return float(loss), bool(stepped)


def full_state(pm) -> dict:
    return {k: v.detach().clone() for k, v in pm.full_state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def write_cut_short(exit_fn):
    """A replacement for DCP's ``_write_item`` that writes half of the item's bytes, flushes
    them to disk and then calls ``exit_fn`` (a rank dying in the middle of its shard)."""
    original = dcp_fs._write_item

    def cut(transforms, stream, data, write_item, storage_key, serialization_format):
        buf = io.BytesIO()
        original(transforms, buf, data, write_item, storage_key, serialization_format)
        stream.write(buf.getvalue()[: max(1, len(buf.getvalue()) // 2)])
        stream.flush()
        exit_fn()
    return cut


# ---- inproc ----------------------------------------------------------------------------------
def plain(root: str) -> tuple:
    """STEPS steps without a fault; a checkpoint at step 2; the final weights."""
    pm, opt = build(root)
    losses = {}
    for s in range(1, STEPS + 1):
        losses[s] = step(pm, opt, s)[0]
        if s == 2:
            save_step_checkpoint(os.path.join(root, "plain"), s, pm, opt, extra={"step": s})
    final = full_state(pm)
    if dist.get_rank() == 0:
        torch.save(final, os.path.join(root, "plain_final.pt"))
        log(root, case="plain", losses=losses)
    return pm, opt


def sigterm(root: str) -> None:
    ckpt_root = os.path.join(root, "sigterm")
    pm, opt = build(root)
    rank = dist.get_rank()
    losses, signalled_at = {}, None
    with autopar.Preemption() as preempt:
        for s in range(1, STEPS + 1):
            if rank == 1 and s == SIGTERM_STEP:
                signalled_at = time.time()
                os.kill(os.getpid(), signal.SIGTERM)      # as the scheduler would
            losses[s] = step(pm, opt, s)[0]
            if preempt.save_if_requested(ckpt_root, s, pm, opt, extra={"step": s}):
                break
    log(root, case="sigterm", rank=rank, received=preempt.received, saved=preempt.saved,
        saved_step=s, losses=losses, signalled_at=signalled_at, save_seconds=preempt.save_seconds,
        done_at=time.time())
    # the job restarts: a new module (other initial weights) resumes from that checkpoint
    pm, opt = build(root, seed=1)
    extra = autopar.load_checkpoint(latest_checkpoint(ckpt_root), pm, opt)
    resumed = {s: step(pm, opt, s)[0] for s in range(extra["step"] + 1, STEPS + 1)}
    if rank == 0:
        log(root, case="sigterm_resume", from_step=extra["step"], losses=resumed,
            latest=os.path.basename(latest_checkpoint(ckpt_root)))


def nan(root: str) -> None:
    rank = dist.get_rank()

    def poison():
        if rank == 1:     # one element of one of rank 1's gradients (its ZeRO-3 shard)
            p = next(p for p in pm.parameters() if p.grad is not None)
            p.grad.view(-1)[0] = float("nan")
    pm, opt = build(root)
    losses, stepped = {}, {}
    for s in range(1, 6):
        losses[s], stepped[s] = step(pm, opt, s, skip_nonfinite=True,
                                     before_step=poison if s == NAN_STEP else None)
    got = full_state(pm)
    ref_pm, ref_opt = build(root)
    for s in (1, 2, 4, 5):      # the same run without step 3's batch
        step(ref_pm, ref_opt, s)
    diff = max_diff(got, full_state(ref_pm))
    log(root, case="nan", rank=rank, losses=losses, stepped=stepped,
        skips=getattr(pm, "nonfinite_skips", []), diff_to_run_without_step=diff)


def enospc(root: str, pm, opt) -> None:
    rank = dist.get_rank()
    ckpt_root = os.path.join(root, "plain")
    original = dcp_fs._write_item

    def disk_full(*args, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if rank == 1:
        dcp_fs._write_item = disk_full
    t0 = time.monotonic()
    try:
        save_step_checkpoint(ckpt_root, 6, pm, opt, extra={"step": 6})
        raised = None
    except Exception as e:  # noqa: BLE001 - the test checks type and message
        raised = e
    finally:
        dcp_fs._write_item = original
    seconds = time.monotonic() - t0
    dist.barrier()
    log(root, case="enospc", rank=rank, raised=type(raised).__name__ if raised else None,
        error=str(raised) if raised else None, seconds=seconds,
        latest=os.path.basename(latest_checkpoint(ckpt_root) or ""),
        listing=sorted(os.listdir(ckpt_root)))


def damaged(root: str, pm, opt) -> None:
    """Three copies of the step-2 checkpoint, each with rank 1's shard file damaged."""
    rank = dist.get_rank()
    src = latest_checkpoint(os.path.join(root, "plain"))
    shard = "__1_0.distcp"
    if rank == 0:
        for kind in ("corrupt", "missing", "truncated"):
            dst = os.path.join(root, kind)
            shutil.copytree(src, dst)
            f = os.path.join(dst, shard)
            if kind == "missing":
                os.remove(f)
            elif kind == "truncated":
                os.truncate(f, os.path.getsize(f) // 2)
            else:      # one byte in the middle of the file: a tensor's data
                with open(f, "r+b") as fh:
                    fh.seek(os.path.getsize(f) // 2)
                    b = fh.read(1)
                    fh.seek(-1, 1)
                    fh.write(bytes([b[0] ^ 0xFF]))
    dist.barrier()
    for kind in ("corrupt", "missing", "truncated"):
        t0 = time.monotonic()
        try:
            autopar.load_checkpoint(os.path.join(root, kind), pm, opt)
            raised = None
        except Exception as e:  # noqa: BLE001 - the test checks type and message
            raised = e
        log(root, case=kind, rank=rank, raised=type(raised).__name__ if raised else None,
            error=str(raised) if raised else None, seconds=time.monotonic() - t0,
            file=os.path.join(root, kind, shard))
    # the intact one still loads (nothing above changed it)
    extra = autopar.load_checkpoint(src, pm, opt)
    log(root, case="intact", rank=rank, extra=extra)


def stall(root: str) -> None:
    rank = dist.get_rank()
    pm, opt = build(root, timeout=STALL_TIMEOUT)
    dist.barrier()
    if rank == 1:       # alive, but never joins the step's collectives, until rank 0 is done
        end = time.monotonic() + STALL_TIMEOUT + 30
        while time.monotonic() < end and not any(e.get("case") == "stall" for e in events(root)):
            time.sleep(0.05)
        return
    t0 = time.monotonic()
    try:
        step(pm, opt, 1)
        raised = None
    except Exception as e:  # noqa: BLE001 - the test checks type and message
        raised = e
    log(root, case="stall", rank=rank, raised=type(raised).__name__ if raised else None,
        error=str(raised) if raised else None, seconds=time.monotonic() - t0,
        op=getattr(raised, "op", None), axis=getattr(raised, "axis", None),
        ranks=getattr(raised, "ranks", None), timed_out=getattr(raised, "timed_out", None))


def _outcome(e: BaseException | None) -> dict:
    return {"raised": type(e).__name__ if e else None, "error": str(e) if e else None,
            "raised_at": time.time()}


def oom(root: str) -> None:
    """Rank 1 allocates more than any device holds (2**60 bytes: ``torch.OutOfMemoryError``
    on CUDA, the CPU allocator's error on the CPU) in the forward of step ``OOM_STEP``."""
    rank = dist.get_rank()
    ckpt_root = os.path.join(root, "oom")
    # a long timeout, so that rank 0's error within it is rank 1's notice; it also gives the
    # module process groups of its own (the default group stays clean for the cases after)
    pm, opt = build(root, timeout=OOM_TIMEOUT)
    losses = {}

    def out_of_memory(module, args):
        hook.remove()
        log(root, case="oom_injected", rank=rank, injected_at=time.time())
        torch.empty(2 ** 60, dtype=torch.uint8, device=pm.device)
    raised = None
    for s in range(1, OOM_STEP + 1):
        if rank == 1 and s == OOM_STEP:
            hook = torch.nn.modules.module.register_module_forward_pre_hook(out_of_memory)
        try:
            losses[s] = step(pm, opt, s)[0]
        except Exception as e:  # noqa: BLE001 - the test checks type and message
            raised = e
            break
        if s == 2:
            save_step_checkpoint(ckpt_root, s, pm, opt, extra={"step": s})
    log(root, case="oom", rank=rank, step=s, losses=losses, **_outcome(raised),
        peer_fault=getattr(raised, "peer_fault", None), oom_step=getattr(raised, "step", None),
        latest=os.path.basename(latest_checkpoint(ckpt_root) or ""), listing=sorted(os.listdir(ckpt_root)))
    # the job restarts: a new module resumes from the last complete checkpoint
    pm, opt = build(root, seed=1)
    extra = autopar.load_checkpoint(latest_checkpoint(ckpt_root), pm, opt)
    resumed = {s: step(pm, opt, s)[0] for s in range(extra["step"] + 1, 6)}
    log(root, case="oom_resume", rank=rank, from_step=extra["step"], losses=resumed)


def save_stall(root: str, pm, opt) -> None:
    """Rank 1's writer stalls (a hung file system) in the step-4 save, until rank 0 has
    reported; a step-2 checkpoint was saved before."""
    rank = dist.get_rank()
    ckpt_root = os.path.join(root, "save_stall")
    save_step_checkpoint(ckpt_root, 2, pm, opt, extra={"step": 2})
    bad_timeouts = {}
    for bad in (0, -1, True, "10", float("inf"), float("nan")):     # refused before any collective
        try:
            save_step_checkpoint(ckpt_root, 4, pm, opt, timeout=bad)
        except Exception as e:  # noqa: BLE001 - the test checks type and message
            bad_timeouts[repr(bad)] = f"{type(e).__name__}: {e}"
    original = dcp_fs._write_item

    def stalled(*args, **kw):
        dcp_fs._write_item = original           # the first item stalls; the rest are written
        log(root, case="save_stalled", rank=rank, stalled_at=time.time())
        end = time.monotonic() + SAVE_TIMEOUT + 30
        while time.monotonic() < end and not any(e.get("case") == "save_stall" for e in events(root)):
            time.sleep(0.05)
        return original(*args, **kw)
    if rank == 1:
        dcp_fs._write_item = stalled
    t0 = time.monotonic()
    try:
        save_step_checkpoint(ckpt_root, 4, pm, opt, extra={"step": 4}, timeout=SAVE_TIMEOUT)
        raised = None
    except Exception as e:  # noqa: BLE001 - the test checks type and message
        raised = e
    finally:
        dcp_fs._write_item = original
    seconds = time.monotonic() - t0
    if rank == 0:
        log(root, case="save_stall", rank=rank, seconds=seconds, ranks=getattr(raised, "ranks", None),
            bad_timeouts=bad_timeouts,
            latest=os.path.basename(latest_checkpoint(ckpt_root) or ""),
            listing=sorted(os.listdir(ckpt_root)), **_outcome(raised))
    dist.barrier()
    extra = autopar.load_checkpoint(latest_checkpoint(ckpt_root), pm, opt)    # still loads
    log(root, case="save_stall_load", rank=rank, extra=extra, **_outcome(raised))


def died_writing(root: str, pm, opt) -> None:
    """Rank 1 ends half way through its shard of the step-8 checkpoint."""
    rank = dist.get_rank()
    ckpt_root = os.path.join(root, "plain")
    if rank == 1:
        def die():
            log(root, case="died_writing", rank=1, died_at=time.time())
            os._exit(0)
        dcp_fs._write_item = write_cut_short(die)
    t0 = time.monotonic()
    try:
        save_step_checkpoint(ckpt_root, 8, pm, opt, extra={"step": 8})
        raised = None
    except Exception as e:  # noqa: BLE001 - the test checks type and message
        raised = e
    seconds = time.monotonic() - t0
    partial = os.path.join(ckpt_root, ".step-00000008.tmp")
    try:      # the partial checkpoint is refused before any collective: rank 0 alone may try
        autopar.load_checkpoint(partial, pm, opt)
        refused = None
    except Exception as e:  # noqa: BLE001 - the test checks type and message
        refused = e
    log(root, case="died_writing", rank=rank, raised=type(raised).__name__ if raised else None,
        error=str(raised) if raised else None, seconds=seconds,
        latest=os.path.basename(latest_checkpoint(ckpt_root) or ""),
        listing=sorted(os.listdir(ckpt_root)), partial_files=sorted(os.listdir(partial)),
        load_refused=type(refused).__name__ if refused else None,
        load_error=str(refused) if refused else None)


def inproc(root: str) -> None:
    pm, opt = plain(root)
    sigterm(root)
    nan(root)
    enospc(root, pm, opt)
    damaged(root, pm, opt)
    stall(root)
    oom(root)
    save_stall(root, pm, opt)
    died_writing(root, pm, opt)


# ---- chain / resume ---------------------------------------------------------------------------
def chain(root: str) -> None:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = dist.get_rank()
    ckpt_root = os.path.join(root, "ckpt")
    pm, opt = build(root, seed=attempt)     # other weights each time: the checkpoint must win
    start = 0
    ckpt = latest_checkpoint(ckpt_root)
    if ckpt is not None:
        start = autopar.load_checkpoint(ckpt, pm, opt)["step"]
    log(root, case="start", attempt=attempt, rank=rank, resumed_from=start)
    kill = CHAIN_KILLS.get(attempt)
    preempt = None
    if kill is None:       # attempt 4: the partial checkpoint is refused, then a preemption
        partial = os.path.join(ckpt_root, ".step-00000004.tmp")
        try:
            autopar.load_checkpoint(partial, pm, opt)
            raised = None
        except Exception as e:  # noqa: BLE001 - the test checks type and message
            raised = e
        log(root, case="partial_load", rank=rank, exists=os.path.isdir(partial),
            raised=type(raised).__name__ if raised else None, error=str(raised) if raised else None)
        preempt = autopar.Preemption()

    def die(where):
        log(root, case="kill", attempt=attempt, rank=rank, where=where)
        os.kill(os.getpid(), signal.SIGKILL)
    losses = {}
    for s in range(start + 1, STEPS + 1):
        if rank == 1 and s == 3 and kill == "forward":
            torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: die("forward"))
        if rank == 1 and s == 3 and kill == "backward":
            next(iter(pm.parameters())).register_hook(lambda g: die("backward"))
        if rank == 1 and s == 3 and kill == "optimizer":
            opt.register_step_pre_hook(lambda *a: die("optimizer"))
        try:
            losses[s] = step(pm, opt, s)[0]
            if s % EVERY == 0:
                if rank == 1 and kill == "checkpoint":
                    dcp_fs._write_item = write_cut_short(lambda: die("checkpoint"))
                save_step_checkpoint(ckpt_root, s, pm, opt, extra={"step": s})
        except Exception as e:  # noqa: BLE001 - a survivor's error, reported
            log(root, case="survivor", attempt=attempt, rank=rank, raised=type(e).__name__,
                error=str(e)[:600], step=s)
            raise
        log(root, case="step", attempt=attempt, rank=rank, step=s, loss=losses[s])
        if preempt is not None:
            time.sleep(SLOW_STEP_S)
            if preempt.save_if_requested(ckpt_root, s, pm, opt, extra={"step": s}):
                log(root, case="preempted", attempt=attempt, rank=rank, step=s, saved=preempt.saved,
                    save_seconds=preempt.save_seconds, received_at_wall=time.time()
                    - (time.monotonic() - preempt.received_at) if preempt.received_at else None)
                return
    log(root, case="chain_end", attempt=attempt, rank=rank)


def resume(root: str) -> None:
    rank = dist.get_rank()
    pm, opt = build(root, seed=7)
    ckpt = latest_checkpoint(os.path.join(root, "ckpt"))
    start = autopar.load_checkpoint(ckpt, pm, opt)["step"]
    losses = {s: step(pm, opt, s)[0] for s in range(start + 1, STEPS + 1)}
    final = full_state(pm)
    if rank == 0:
        torch.save(final, os.path.join(root, "resumed_final.pt"))
        log(root, case="resumed", from_step=start, losses=losses, checkpoint=os.path.basename(ckpt))
    plain(root)


def overhead(root: str, steps: int = 40) -> None:
    """``benchmarks/faults.py``: the per-step cost of the guards (median seconds of a step
    plain, with ``Preemption.save_if_requested`` when nothing was received, with
    ``skip_nonfinite=True``) and of the checksums in a save."""
    import statistics
    from autopar.runtime.ckpt_files import write_checksums
    pm, opt = build(root)
    preempt = autopar.Preemption()
    times: dict[str, list[float]] = {"plain": [], "preemption_check": [], "skip_nonfinite": []}
    for k in range(steps):
        for kind in times:
            dist.barrier()
            t0 = time.perf_counter()
            step(pm, opt, 1 + k % STEPS, skip_nonfinite=kind == "skip_nonfinite")
            if kind == "preemption_check":
                preempt.save_if_requested(os.path.join(root, "never"), k, pm, opt)
            times[kind].append(time.perf_counter() - t0)
    preempt.close()
    saves, sums = [], []
    for k in range(5):
        path = os.path.join(root, f"save{k}")
        dist.barrier()
        t0 = time.perf_counter()
        autopar.save_checkpoint(path, pm, opt)
        saves.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        write_checksums(path)
        sums.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        log(root, case="overhead", **{k: statistics.median(v) for k, v in times.items()},
            save=statistics.median(saves), checksums=statistics.median(sums),
            shard_bytes=sum(os.path.getsize(os.path.join(root, "save0", f))
                            for f in os.listdir(os.path.join(root, "save0")) if f.endswith(".distcp")))


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))     # bounded, whatever fails
    faulthandler.dump_traceback_later(240, exit=True)     # a hang shows every rank's stack
    {"inproc": inproc, "chain": chain, "resume": resume, "overhead": overhead}[mode](root)
    sys.stdout.flush()
    sys.stderr.flush()
    # leave without tearing the groups down: they hold the stalled step's never-joined ops
    os._exit(0)


if __name__ == "__main__":
    main()


# ---- the launches (run by the test and benchmarks/faults.py, in the parent process) -------------
def _torchrun(mode: str, root: str, *extra_args: str) -> list[str]:
    """``--standalone``: a c10d rendezvous on a free port, which (with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``) gives each restart a fresh store; a static
    ``--master-port`` store keeps the dead attempt's gloo addresses ("Connection refused")."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            *extra_args, os.path.abspath(__file__), mode, root]


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env.pop("AUTOPAR_COLLECTIVE_TIMEOUT", None)
    return env


def _tail(text: str) -> str:
    return "\n".join(x for x in text.splitlines() if "Warning" not in x and "return func(" not in x)[-6000:]


def run_inproc(root: str, timeout: float = 400, mode: str = "inproc") -> tuple[int, str, float]:
    """The ``inproc`` launch (or another one-launch ``mode``): (return code, its stderr's
    tail, wall seconds)."""
    import subprocess
    t0 = time.monotonic()
    proc = subprocess.run(_torchrun(mode, root), capture_output=True, text=True,
                          timeout=timeout, env=_env())
    return proc.returncode, _tail(proc.stderr), time.monotonic() - t0


def run_chain(root: str, timeout: float = 900) -> dict:
    """The ``chain`` launch (``torchrun --max-restarts 4``), SIGTERM sent to the torchrun agent
    once attempt 4 has taken a step, then the ``resume`` launch: return codes, logs, the
    moment of the SIGTERM and the wall seconds."""
    import subprocess
    t0 = time.monotonic()
    out = {}
    with open(os.path.join(root, "chain.log"), "w") as logf:
        proc = subprocess.Popen(_torchrun("chain", root, "--max-restarts", "4", "--monitor-interval", "0.5"),
                                stdout=logf, stderr=subprocess.STDOUT, text=True, env=_env())
        sent = None
        while proc.poll() is None and time.monotonic() - t0 < timeout:
            if sent is None and any(e.get("case") == "step" and e.get("attempt") == 4 for e in events(root)):
                sent = time.time()
                proc.send_signal(signal.SIGTERM)          # the scheduler preempts the job
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    out["chain_rc"], out["sigterm_sent"] = proc.returncode, sent
    out["chain_log"] = _tail(open(os.path.join(root, "chain.log")).read())
    proc2 = subprocess.run(_torchrun("resume", root), capture_output=True, text=True,
                           timeout=timeout, env=_env())
    out["resume_rc"], out["resume_log"] = proc2.returncode, _tail(proc2.stderr)
    out["seconds"] = time.monotonic() - t0
    return out
