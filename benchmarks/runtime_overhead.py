"""Runtime overhead: each autopar pinned plan against the same strategy written by hand in
torch (``benchmarks/hand_written.py``), on the same small GPT, ranks and global batch, in
one run, steps alternating (autopar, hand, hand, autopar, ...) so machine noise hits both.

    python benchmarks/runtime_overhead.py --nproc 2 [--steps 20] [--only data,zero]
    python benchmarks/runtime_overhead.py --nproc 4
    python benchmarks/runtime_overhead.py --nproc 1          # rewritten graph vs eager
    python benchmarks/runtime_overhead.py --nproc 2 --only zero --profile 0   # cProfile, rank 0
    python benchmarks/runtime_overhead.py --nproc 2 --compile    # the compiled rows (below)

strategy (autopar pins; N ranks) -> by hand:

- data (data=N) -> DistributedDataParallel (autopar's step, like DDP's, runs only the
  bucketed gradient all-reduce: the loss's count of targets comes from the whole target,
  the loss is summed beside backward, wpe's gradient goes to the buckets: 1.00-1.02 on 2
  and 4 ranks, two runs each at load 8-14; with those three blocking all-reduces it was 1.03
  and 1.13)
- zero (data=N, zero=3) -> FSDP2: fully_shard per block, then the root (autopar gathers and
  reduce-scatters per block too, ~19 collectives a step: 0.95-1.03 on 2 ranks, 0.91-1.05 on
  4, four runs each at load 9-40; per weight, ~140 a step, it was 1.44 and 2.90)
- tensor (tensor=N) -> parallelize_module, Colwise/RowwiseParallel (Megatron's layout)
- pipeline (pipeline=N, 1F1B, 2N micro-batches) -> manual split into N stages of
  consecutive blocks, PipelineStage + Schedule1F1B; autopar's cuts are the solver's
  (0.98-1.02 on 2 ranks, 1.01-1.05 on 4, two runs each at load 12-16: the solver now cuts
  at block boundaries, as the hand split, since each tensor crossing a cut costs a message
  each way per micro-batch (stage_dp); it cut mid-block, before a block's c_attn, so the
  residual and ln_1's output both crossed: 1.04-1.05 and 1.06-1.07)
- pipeline-gpipe (the same, GPipe) -> the same, ScheduleGPipe (0.89-1.02 on 2 ranks,
  0.99-1.07 on 4)
- pipeline-samecuts (pipeline 1F1B, the plan's cuts moved to the hand split's) -> as
  pipeline: the two runtimes on the very same stages (0.95-1.05 on 2 ranks, 1.03-1.04 on 4)
- eager (N=1: the solver's plan at world 1) -> the model itself: the host overhead of the
  rewritten graph; eager-tiny: the same on a GPT with negligible compute (n_embd 32,
  batch 1, seq 16), so the difference is the per-step host overhead (the rewritten graph
  runs the eager model's ATen ops, the same ones and as many; a loss placed
  vocabulary-parallel on the one-rank axis used to add an all-gather and two all-reduces;
  the program's ops are called through torch's Python bindings, as eager calls them
  (``passes/fast_bindings.py``; as ``torch.ops.aten`` overloads, ~6-12 us slower a call,
  it was 1.08, +0.74 ms at load 6-9): 0.96-1.07, the median step 0.2-0.65 ms below
  eager's, three runs at load 10-18; eager 1.00-1.03)

``--compile``: autopar with ``compile=True`` against the hand strategy through
``torch.compile`` (Inductor; DDP's and FSDP2's graph breaks as their users get them), and
against autopar eager (``*-vs-eager``):

- data-compiled -> ``torch.compile(DDP(model))``; zero-compiled -> FSDP2, then
  ``torch.compile``; tensor-compiled -> ``parallelize_module``, then ``torch.compile``.
  On 2 ranks at load 7-8 (2026-11-27): 1.00, 0.73, 0.91; against autopar eager 0.96, 0.77,
  0.79. Before Inductor's collective bucketing (``runtime.compiled.INDUCTOR_OPTIONS``),
  one gather per weight made the compiled ZeRO-3 step 2.28x FSDP2's and 2.92x eager's.
  On 4 ranks at load 3-10: 0.94, 0.60, 1.04 (1.06 in a second run of 30 steps); against
  autopar eager 1.00, 0.67, 0.73. The tensor row's 4-6% is the plan, not the compiled
  runtime: autopar's ``tensor=4`` plan of this GPT issues 20 all-reduces and 3 all-gathers
  a step (vocabulary-parallel embedding and loss, a sharded position embedding: the
  solver's choice for gloo) where Megatron's layout issues 16 all-reduces.

A timed step is ``zero_grad``, forward, backward, gradient sync and ``optimizer.step``
(SGD, the same for both), between two barriers. Before timing, each pair runs one step
from the same weights and prints both global losses (they must agree: the check that the
two do the same work). Rank 0 prints, per strategy, the median step of each and the median
of the per-pair ratios autopar / hand (1.00 = no overhead).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import io
import os
import pstats
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autopar  # noqa: E402
import hand_written  # noqa: E402
from examples.models import gpt_factory  # noqa: E402

GLOBAL_BATCH = 16
WARMUP = 3


def strategies(world: int, compiled: bool = False) -> dict:
    """name -> (autopar pins, hand builder(model, x, y, loss_fn) -> Hand)."""
    mb = 2 * world
    if compiled:       # --compile: both sides through torch.compile; then autopar vs itself
        return {
            "data-compiled": ({"data": world, "compile": True},
                              functools.partial(hand_written.ddp, compile=True)),
            "zero-compiled": ({"data": world, "zero": 3, "compile": True},
                              functools.partial(hand_written.fsdp, compile=True)),
            "tensor-compiled": ({"tensor": world, "compile": True},
                                functools.partial(hand_written.tensor, compile=True)),
            "data-vs-eager": ({"data": world, "compile": True}, autopar_eager({"data": world})),
            "zero-vs-eager": ({"data": world, "zero": 3, "compile": True},
                              autopar_eager({"data": world, "zero": 3})),
            "tensor-vs-eager": ({"tensor": world, "compile": True}, autopar_eager({"tensor": world})),
        }
    if world == 1:
        return {"eager": ({}, eager), "eager-tiny": ({}, eager)}
    out = {
        "data": ({"data": world}, hand_written.ddp),
        "zero": ({"data": world, "zero": 3}, hand_written.fsdp),
        "tensor": ({"tensor": world}, hand_written.tensor),
        "pipeline": ({"pipeline": world, "micro_batch_size": GLOBAL_BATCH // mb, "schedule": "1f1b"},
                     lambda m, x, y, f: hand_written.pipeline(m, x, y, f, mb, "1f1b")),
        "pipeline-gpipe": ({"pipeline": world, "micro_batch_size": GLOBAL_BATCH // mb,
                            "schedule": "gpipe"},
                           lambda m, x, y, f: hand_written.pipeline(m, x, y, f, mb, "gpipe")),
        # the 1F1B plan with its cuts moved to the hand split's (block boundaries): the
        # runtimes compared on the very same stages
        "pipeline-samecuts": ({"pipeline": world, "micro_batch_size": GLOBAL_BATCH // mb,
                               "schedule": "1f1b"},
                              lambda m, x, y, f: hand_written.pipeline(m, x, y, f, mb, "1f1b")),
    }
    return out


def eager(model, x, y, loss_fn) -> hand_written.Hand:
    import copy
    m = copy.deepcopy(model)

    def step():
        loss = loss_fn(m(x), y)
        loss.backward()
        return loss
    return hand_written.Hand(list(m.parameters()), step, lambda loss: loss.detach())


def autopar_eager(pins: dict):
    """A builder whose "hand" side is autopar itself, eager, under ``pins``: the rows
    ``*-vs-eager`` time autopar compiled against autopar eager."""
    def build(model, x, y, loss_fn) -> hand_written.Hand:
        import copy
        pm = autopar.parallelize(copy.deepcopy(model), (x,), loss_fn, target=y, **pins)
        return hand_written.Hand(list(pm.parameters()), lambda: pm.train_step(x, target=y),
                                 lambda loss: loss.detach())
    return build


def block_cuts(model, stages: int) -> tuple[str, ...]:
    """The hand split's cuts as graph nodes: stage ``s`` begins at its first block's ``ln_1``
    (the captured graph names the GPT's layer norms ``layer_norm``, ``layer_norm_1``, ...,
    two per block)."""
    per = len(model.transformer.h) // stages
    return tuple(f"layer_norm_{2 * s * per}" for s in range(1, stages))


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def compare(name, pins, build, ex, steps, profile) -> dict:
    rank = dist.get_rank()
    x, y = ex.inputs[0], ex.target
    import copy
    pm = autopar.parallelize(copy.deepcopy(ex.model), ex.inputs, ex.loss_fn, target=ex.target, **pins)
    if name == "pipeline-samecuts":
        plan = dataclasses.replace(pm.plan, pipeline=dataclasses.replace(
            pm.plan.pipeline, stage_cuts=block_cuts(ex.model, pm.plan.pipeline_stages)))
        pm = autopar.parallelize(copy.deepcopy(ex.model), ex.inputs, ex.loss_fn, target=ex.target,
                                 plan=plan)
    popt = torch.optim.SGD(pm.parameters(), lr=0.01)
    hand = build(ex.model, x, y, ex.loss_fn)
    hopt = torch.optim.SGD(hand.params, lr=0.01)

    def ap_step():
        popt.zero_grad()
        loss = pm.train_step(x, target=y)
        pm.step(popt)
        return loss

    def hand_step():
        hopt.zero_grad()
        loss = hand.step()
        hopt.step()
        return loss

    # the first step, from the same weights: the same global loss
    l_ap = float(ap_step())
    l_hand = float(hand.global_loss(hand_step()))
    ok = abs(l_ap - l_hand) <= 1e-5 * max(1.0, abs(l_hand))
    if rank == 0:
        print(f"[{name}] first-step loss autopar {l_ap:.8f}  hand {l_hand:.8f}  "
              f"|diff| {abs(l_ap - l_hand):.1e}  {'equal' if ok else 'DIFFERENT'}", flush=True)
    ta, th = [], []
    for i in range(WARMUP + steps):
        pair = (ap_step, hand_step) if i % 2 == 0 else (hand_step, ap_step)
        t = [timed(f) for f in pair]
        if i >= WARMUP:
            a, h = (t[0], t[1]) if i % 2 == 0 else (t[1], t[0])
            ta.append(a)
            th.append(h)
    if profile is not None and rank == profile:
        for label, fn in (("autopar", ap_step), ("hand", hand_step)):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5):
                fn()
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            print(f"--- cProfile rank {rank}, {name} {label}, 5 steps ---\n{buf.getvalue()}", flush=True)
    elif profile is not None:
        for _ in range(5):
            ap_step()
        for _ in range(5):
            hand_step()
    ratios = [a / h for a, h in zip(ta, th)]
    return dict(name=name, pins=pins, ap=statistics.median(ta), hand=statistics.median(th),
                ratio=statistics.median(ratios), ok=ok)


def worker(steps: int, only: list[str] | None, profile: int | None, compiled: bool = False) -> None:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    ex = gpt_factory(batch=GLOBAL_BATCH, n_embd=128, n_layer=4, n_head=4, vocab_size=256,
                     block_size=64, seq_len=64)
    todo = strategies(world, compiled)
    if only:
        unknown = set(only) - set(todo)
        if unknown:
            raise SystemExit(f"--only {sorted(unknown)}: not a strategy at {world} ranks; "
                             f"choose from {sorted(todo)}")
        todo = {k: v for k, v in todo.items() if k in only}
    tiny = gpt_factory(batch=1, n_embd=32, n_layer=4, n_head=4, vocab_size=64, block_size=16,
                       seq_len=16)
    rows = [compare(name, pins, build, tiny if name == "eager-tiny" else ex, steps, profile)
            for name, (pins, build) in todo.items()]
    if rank == 0:
        print(f"\nmodel: GPT 4 layers, n_embd 128, n_head 4, vocab 256, seq 64, global batch "
              f"{GLOBAL_BATCH}, {world} gloo rank(s), median of {steps} alternating steps"
              + ("; eager-tiny: n_embd 32, vocab 64, seq 16, batch 1" if "eager-tiny" in todo else ""))
        print(f"{'strategy':<18} {'autopar pins':<44} {'autopar ms':>10} {'hand ms':>9} "
              f"{'diff ms':>8} {'ratio':>6}  first-step loss")
        for r in rows:
            pins = ", ".join(f"{k}={v}" for k, v in r["pins"].items()) or "(solver's choice)"
            print(f"{r['name']:<18} {pins:<44} {r['ap'] * 1e3:10.2f} {r['hand'] * 1e3:9.2f} "
                  f"{(r['ap'] - r['hand']) * 1e3:8.2f} {r['ratio']:6.2f}  {'equal' if r['ok'] else 'DIFFERENT'}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated strategies (default: all)")
    ap.add_argument("--profile", type=int, default=None, metavar="RANK",
                    help="after timing, cProfile 5 steps of each on this rank")
    ap.add_argument("--compile", action="store_true",
                    help="the compiled rows: autopar compile=True against the hand strategy "
                         "through torch.compile, and against autopar eager")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s] or None
    if args.worker:
        worker(args.steps, only, args.profile, args.compile)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), os.path.abspath(__file__),
           "--worker", "--steps", str(args.steps), *(["--only", args.only] if args.only else []),
           *(["--compile"] if args.compile else []),
           *(["--profile", str(args.profile)] if args.profile is not None else [])]
    sys.exit(subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}))


if __name__ == "__main__":
    main()
