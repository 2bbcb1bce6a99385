"""autopar's first GPU run, prepared: one script that checks on a CUDA machine what the CPU
tests cannot (issue 30, item 2), in at most about 7 minutes on one H100.

Run, from the repository root (autopar need not be installed)::

    PYTHONPATH=. python3 benchmarks/gpu_check.py              # on a machine with a GPU
    PYTHONPATH=. python3 benchmarks/gpu_check.py --dry        # on a CPU, tiny sizes, < 1 min
    python benchmarks/gpu_check.py --prepare                  # here, with OR-Tools: the data file

It writes a JSON report (``--out``; default ``benchmarks/results/gpu_check_<gpu>.json``,
a temporary file with ``--dry``) and prints a summary. Sections, each of which records its
error (message and traceback tail) and lets the next one run, skipped once ``--budget-s``
(default 480 s) is spent; they run in the order environment, equivalence, offload,
multi_gpu (what no earlier loan ran first), op_timing, plan_shapes, memory, fp8_gemms, moe,
compile, autopar_compile, attention_backends, scale:

1. ``equivalence``: the small GPT of ``examples/gpt.py`` and a transformers Llama
   (``LlamaConfig``: 4 layers, hidden 512, GQA, SDPA; no download) trained 20 steps
   through ``autopar.parallelize`` at world 1 (an NCCL process group of one rank, made
   here), mixed precision ``precision="bf16"``, SGD with momentum, against eager training
   of a deep copy under ``torch.autocast(bfloat16)`` on the same batches. Pass: the loss
   of every step within ``LOSS_RTOL`` relative and every parameter after the steps within
   ``PARAM_RTOL`` (relative norm of the difference). Both are loose because the two runs
   round activations to bf16 (8 significant bits, unit roundoff 2^-8 = 3.9e-3) and their
   kernels may sum in other orders (atomics in attention and embedding backward);
2. ``op_timing``: ``autopar.runtime.timing.timing_report`` of both models (its table text
   is in the report) with every ATen op timed between two device synchronisations (as
   ``OpTimer`` does on a GPU: else it would time the launch, not the kernel), by family (memory-bound ops included) against the plan's price table;
   GEMMs by shape and attention by query shape, forward and backward, against the cost
   model; the optimizer step against ``cost_models.step.optimizer_step_time``;
3. ``plan_shapes``: the GEMM and attention ops of the free plans of
   ``benchmarks/plan_quality.py`` (the shapes the free search exploits) timed alone in
   bf16 (CUDA events, warm-up, median), against ``cost_models.compute.node_time`` for
   this GPU. Their shapes and the predictions for A100, H100 and H200 are prepared on a
   CPU (``--prepare``: the GPU machine has no OR-Tools) in
   ``benchmarks/data/gpu_check_shapes.json``;
4. ``memory``: the peak of ``torch.cuda.max_memory_allocated`` over the 20 steps against
   the plan's memory estimate; ``compile``: the GPT's, the Llama's and the Mixtral's eager
   single-device step against ``torch.compile`` of it (in a subprocess with a timeout; an
   error is recorded); the summary's ``speed`` lines: autopar eager over torch eager and
   autopar ``compile=True`` over ``torch.compile`` (issue 42's goals 1.05 and 1.0);
   ``offload``: the GPT and the Llama under ``offload_activations="full"`` (pinned host
   memory, a side stream, a layer prefetched in backward) trained as in 1., their peak
   memory against the estimate and against the run without offload;
5. ``attention_backends``: causal SDPA in bf16 at a few shapes (8k tokens, 128-dim heads; a
   16k sequence) under each of torch's backends (FlashAttention-2, cuDNN, memory-efficient)
   and torch's default, as fractions of the dense peak against the cost model's
   ``attention_efficiency`` (which kernel the H100 constant should describe);
   ``fp8_gemms``: ``precision="fp8"``'s linear (``autopar.ops.fp8``) at Llama-3-8B's
   projection shapes, tensorwise and rowwise, forward and backward, against
   ``cost_models.fp8.fp8_linear_time`` and against the bf16 linear (``gpu_check_fp8.py``);
6. ``moe``: transformers' Mixtral (4 layers, top-2 of 8 experts) trained as in 1., each MoE
   layer one ``autopar::moe_experts`` op running the experts class's own forward here;
7. ``autopar_compile``: the GPT, the Llama and the Mixtral through ``parallelize(compile=True)`` (Inductor, Triton on a
   GPU) trained as in 1., against one device, with its compile seconds, and its step
   against autopar eager's (1.) and the single-device ``torch.compile`` step (4.); then
   each under ``compile="reduce-overhead"`` (CUDA graphs), its step against
   ``compile=True``'s and its host time as priced (``cost_models.host.graphs_dispatches``);
8. ``multi_gpu``: ``data=2``, ``tensor=2`` and ZeRO-3 plans of the GPT on 2 ranks
   (torchrun) against one device, each trained by ``train_step`` and by the ordinary loop
   (``loss_fn(pm(x), y).backward()``), each collective probed once, and all-reduce bus
   bandwidth against the cost model's. With one GPU both ranks share it over gloo
   (``AUTOPAR_SHARE_GPUS=1``; NCCL refuses two ranks on one GPU): the multi-rank CUDA paths
   run, the times are gloo's through host memory.
9. ``scale``: one rank's program of real-scale plans (Llama-3-8B ``tensor=8`` at 8,192
   tokens, a Llama-3-70B pipeline stage of a 64-GPU plan, a DeepSeek-V3-shaped MoE stack
   under ``expert=8``) trained on this GPU under torch's fake process group: peak memory
   and compute by op family against the plan (``benchmarks/gpu_check_scale.py``; its plans
   prepared by ``--prepare-scale`` into ``benchmarks/data/gpu_check_scale.json``).

Plans: solved here when OR-Tools imports (``--plans live``); otherwise (``--plans saved``)
the world-1 plans prepared for this GPU (H100, H200) are loaded, which holds only while
this torch captures the same graph (the ``environment`` section says whether it does).
Without OR-Tools ``import autopar`` still works here: a stand-in ``ortools`` module that
fails when solving is installed; the 2-GPU section needs OR-Tools (it solves).

``--dry`` (no GPU needed; ``tests/test_gpu_check.py`` runs it): CUDA hidden, gloo, the
dry-size models, 2 steps, 3 of the shapes shrunk to 64 per dimension, ``torch.compile``
with the ``aot_eager`` backend; the numbers mean nothing, the code paths are the GPU run's.

Limits: world 1 measures no communication; the two models are small, so many ops are
launch-bound; per-op times include a launch and two synchronisations each; a GPU other
than A100 / H100 / H200 is priced with its measured peaks (``cost_models.local_devices``);
the plan_quality shapes are each row's recorded free configuration re-planned on 2 layers
(``gpu_check_ops.FREE_PLANS``), at most 40 of 95.
"""
from __future__ import annotations

import argparse
import copy
import importlib.abc
import importlib.util
import json
import math
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "benchmarks"
DATA = HERE / "data" / "gpu_check_shapes.json"
RESULTS = HERE / "results"

LOSS_RTOL = 2e-2
"""Largest relative loss difference of any step, autopar against eager (bf16 autocast)."""
PARAM_RTOL = 1e-2
"""Largest ||w_autopar - w_eager|| / ||w_eager|| of any parameter after the steps."""
LR, MOMENTUM = 0.05, 0.9


# ---- running without an installed autopar, and without OR-Tools ------------------------------
class _RepoPackages(importlib.abc.MetaPathFinder):
    """``autopar.cost_models`` and ``autopar.passes`` from the top-level ``cost_models/`` and
    ``passes/`` (what pyproject's ``package-dir`` does for an installed autopar)."""
    ALIASES = {"autopar.cost_models": ROOT / "cost_models", "autopar.passes": ROOT / "passes"}

    def find_spec(self, name, path=None, target=None):
        d = self.ALIASES.get(name)
        if d is None:
            return None
        return importlib.util.spec_from_file_location(name, d / "__init__.py",
                                                      submodule_search_locations=[str(d)])


class _NoOrTools(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise ImportError(f"OR-Tools is not installed here ({self.__name__}.{attr}): autopar cannot "
                          "solve a plan; give it a prepared one (gpu_check --plans saved)")


def install_shims() -> tuple[bool, str]:
    """Put the repository first on ``sys.path``, map autopar's two top-level packages, and
    where ``ortools`` does not import, a stand-in that lets ``import autopar`` succeed and
    fails when a plan is solved. Returns (OR-Tools importable, what it is or why not)."""
    for p in (str(HERE), str(ROOT)):
        if p in sys.path:
            sys.path.remove(p)
        sys.path.insert(0, p)
    if not any(isinstance(f, _RepoPackages) for f in sys.meta_path):
        sys.meta_path.insert(0, _RepoPackages())
    try:
        from ortools.linear_solver import pywraplp  # noqa: F401
        import ortools
        return True, f"ortools {getattr(ortools, '__version__', '?')}"
    except Exception as e:  # noqa: BLE001 - any failure to import means: no solver here
        why = f"{type(e).__name__}: {e}"
        for k in [k for k in sys.modules if k == "ortools" or k.startswith("ortools.")]:
            del sys.modules[k]
        top, ls = types.ModuleType("ortools"), types.ModuleType("ortools.linear_solver")
        ls.pywraplp, ls._pywraplp = _NoOrTools("ortools.linear_solver.pywraplp"), \
            _NoOrTools("ortools.linear_solver._pywraplp")
        top.linear_solver = ls
        sys.modules.update({"ortools": top, "ortools.linear_solver": ls,
                            "ortools.linear_solver.pywraplp": ls.pywraplp,
                            "ortools.linear_solver._pywraplp": ls._pywraplp})
        return False, why


HAVE_ORTOOLS, ORTOOLS = install_shims()
# --dry runs on the CPU even where a GPU is (autopar puts a rank on CUDA when it sees one)
GPU_HIDDEN = "--dry" in sys.argv and os.path.exists("/dev/nvidia0")
if "--dry" in sys.argv:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def error_info(e: BaseException) -> dict:
    """An exception's message and traceback tail, and where it was raised from another (torch's
    pipeline stages wrap a stage's error in "failed to run forward") the first one's too."""
    lines = "".join(traceback.format_exception(type(e), e, e.__traceback__)).rstrip().splitlines()
    out = {"error": f"{type(e).__name__}: {e}"[:3000], "traceback_tail": lines[-15:]}
    root = e
    while (root.__cause__ or root.__context__) is not None and len(out) < 50:
        root = root.__cause__ or root.__context__
    if root is not e:
        tail = "".join(traceback.format_exception(type(root), root, root.__traceback__)).rstrip().splitlines()
        out.update(root_error=f"{type(root).__name__}: {root}"[:3000], root_traceback_tail=tail[-15:])
        out["error"] = f"{out['error'][:1500]} [from {out['root_error'][:1400]}]"
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eager_steps(model, data, loss_fn, dev: torch.device) -> tuple[list[float], list[float]]:
    """The reference: ``model`` trained eagerly on ``dev``, one SGD-with-momentum step a
    batch of ``data`` under bf16 autocast; (seconds of each step, losses)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    times, losses = [], []
    for x, y in data:
        x, y = x.to(dev), y.to(dev)
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        sync(dev)
        times.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
    return times, losses


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


class Budget:
    def __init__(self, seconds: float):
        self.total, self.t0 = seconds, time.perf_counter()

    def used(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.total - self.used()


class Ctx:
    """What the sections share."""

    def __init__(self, args):
        self.args = args
        self.dry = args.dry
        self.cuda = torch.cuda.is_available() and not args.dry
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.size = "dry" if args.dry else "gpu"
        self.steps = 2 if args.dry else args.steps
        self.timing_steps, self.timing_warmup = (2, 1) if args.dry else (10, 3)
        self.budget = Budget(args.budget_s)
        self.models: dict[str, dict] = {}
        try:
            self.data = json.loads(DATA.read_text()) if DATA.exists() else None
        except ValueError as e:
            log(f"unreadable {DATA}: {e}")
            self.data = None
        self.gpu_name = torch.cuda.get_device_name(0) if self.cuda else None
        self.dev_key = None              # "h100", "h200", "a100" or None (cost_models.local_devices)
        self._cost_device = None         # the cost model's Device for this device
        self.plan_source = args.plans if args.plans != "auto" else ("live" if HAVE_ORTOOLS else "saved")
        if self.cuda:
            try:
                from autopar.cost_models.local_devices import preset_key
                self.dev_key = preset_key(self.gpu_name)
            except Exception as e:  # noqa: BLE001 - the environment section records it
                log(f"cannot import autopar's cost models: {type(e).__name__}: {e}")

    @property
    def cost_device(self):
        """The cost model's description of this device: the preset of an A100 / H100 / H200
        with the memory it reports, another GPU's measured peaks, or this CPU's."""
        if self._cost_device is None:
            from autopar.cost_models.hardware import parse_cluster
            from autopar.cost_models.local_devices import local_cluster
            cl = local_cluster(1) if self.cuda else "cpu:1"
            self._cost_device = (parse_cluster(cl) if isinstance(cl, str) else cl).device
        return self._cost_device


# ---- plans -----------------------------------------------------------------------------
def plan_kwargs(ctx: Ctx, name: str) -> tuple[dict, str]:
    """``parallelize`` keywords for model ``name``: pins to solve with, or a prepared plan."""
    from autopar import Plan
    if ctx.plan_source == "live":
        return {"precision": "bf16", "optimizer": "sgd_momentum"}, "solved here (OR-Tools)"
    key = ctx.dev_key if ctx.cuda else "cpu"
    saved = ((ctx.data or {}).get("plans", {}).get(ctx.size, {}).get(key or "", {}) or {}).get(name)
    if saved is None:
        raise RuntimeError(f"no OR-Tools here ({ORTOOLS}) and no prepared {ctx.size} plan of {name} for "
                           f"{key!r} in {DATA.relative_to(ROOT)}: carry an ortools wheel, or run "
                           "`python benchmarks/gpu_check.py --prepare` for this GPU")
    return {"plan": Plan.from_dict(saved)}, f"prepared plan {ctx.size}/{key} from {DATA.name}"


def init_process_group(device: torch.device) -> str:
    """A process group of one rank in this process: NCCL on a GPU, gloo on a CPU."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        try:
            dist.init_process_group(backend, rank=0, world_size=1, device_id=device)
            return backend
        except TypeError:            # a torch without device_id=
            pass
    dist.init_process_group(backend, rank=0, world_size=1)
    return backend


# ---- section: environment --------------------------------------------------------------------
def section_environment(ctx: Ctx) -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "ortools": ORTOOLS, "have_ortools": HAVE_ORTOOLS,
           "plan_source": ctx.plan_source, "data_file": str(DATA.relative_to(ROOT)),
           "data_file_present": ctx.data is not None}
    for mod in ("transformers", "numpy", "networkx"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            out[mod] = f"not importable: {type(e).__name__}"
    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=ctx.gpu_name, gpus=torch.cuda.device_count(), gpu_memory_bytes=props.total_memory,
                   sms=props.multi_processor_count, capability=f"{props.major}.{props.minor}",
                   preset=ctx.dev_key)
    d = ctx.cost_device
    out["cost_model_device"] = {"name": d.name, "peak_flops": d.peak_flops, "mem_bandwidth": d.mem_bandwidth,
                                "max_efficiency": d.max_efficiency, "mem_efficiency": d.mem_efficiency,
                                "launch_overhead": d.launch_overhead, "fill_time": d.fill_time,
                                "sms": d.sms, "attention_efficiency": list(d.attention_efficiency or ())}
    if ctx.data:
        out["data_created"] = ctx.data.get("created")
        out["prepared_plans_fresh"] = prepared_plans_fresh(ctx)
    return out


def prepared_plans_fresh(ctx: Ctx) -> dict:
    """Whether each prepared plan of this run's size was made for the graph this torch (and
    transformers) captures: its fingerprint against a capture here (a stale plan only
    matters without OR-Tools: re-run --prepare)."""
    from autopar.capture import capture, fingerprint
    from gpu_check_ops import batches, build_model
    out = {}
    for name in ("gpt", "llama"):
        try:
            model, loss_fn, batch, seq, vocab = build_model(name, ctx.size)
            x, y = batches(1, batch, seq, vocab)[0]
            fp = fingerprint(capture(model, (x,), loss_fn, y))
            plans = ctx.data.get("plans", {}).get(ctx.size, {})
            out[name] = {k: (p[name]["fingerprint"] == fp) for k, p in plans.items() if name in p}
        except Exception as e:  # noqa: BLE001 - recorded
            out[name] = error_info(e)
    return out


# ---- section: equivalence ----------------------------------------------------------------------
def train_and_compare(ctx: Ctx, name: str, key: str | None = None, **extra) -> dict:
    """Model ``name`` trained ``ctx.steps`` steps through ``parallelize`` (keywords ``extra``
    added: ``compile=True``) against eager training on one device; kept in ``ctx.models``
    under ``key`` (default ``name``) for the later sections."""
    import autopar
    from gpu_check_ops import batches, build_model
    dev = ctx.device
    key = key or name
    model, loss_fn, batch, seq, vocab = build_model(name, ctx.size)
    data = batches(ctx.steps, batch, seq, vocab)
    ref = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    kw, source = plan_kwargs(ctx, name)
    kw.update(extra)
    x0, y0 = data[0]
    # what other modules hold on the device (an earlier model's): not this model's peak
    resident = float(torch.cuda.memory_allocated(dev)) if ctx.cuda else 0.0
    t0 = time.perf_counter()
    pm = autopar.parallelize(model, (x0,), loss_fn, target=y0, **kw)
    t_par = time.perf_counter() - t0
    log(f"  {key}: parallelize {t_par:.1f} s ({source}), mesh {tuple(pm.plan.mesh_shape)}, "
        f"cluster {pm.plan.cluster}")
    ctx.models[key] = {"pm": pm, "loss_fn": loss_fn, "x": x0, "y": y0, "peak": None, "ref_peak": None,
                        "resident": resident}
    opt = torch.optim.SGD(pm.parameters(), lr=LR, momentum=MOMENTUM)
    if ctx.cuda:
        sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    losses, steps_s = [], []
    for x, y in data:
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = pm.train_step(x, target=y)
        pm.step(opt)
        losses.append(float(loss.detach()))
        sync(dev)
        steps_s.append(time.perf_counter() - t)
    peak = float(torch.cuda.max_memory_allocated(dev)) - resident if ctx.cuda else None
    got = {n: t.detach().float().cpu() for n, t in pm.full_state_dict().items()}
    # the reference: eager on one device, autocast bf16, the same optimizer and batches
    ref_resident = float(torch.cuda.memory_allocated(dev)) if ctx.cuda else 0.0
    ref.to(dev)
    if ctx.cuda:
        sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    ref_steps_s, ref_losses = eager_steps(ref, data, loss_fn, dev)
    ref_peak = float(torch.cuda.max_memory_allocated(dev)) - ref_resident if ctx.cuda else None
    param_rel, param_moved, missing = {}, {}, []
    for n, p in ref.named_parameters():
        r = p.detach().float().cpu()
        if n not in got:
            missing.append(n)
            continue
        diff = float((got[n] - r).double().norm())
        param_rel[n] = diff / max(float(r.double().norm()), 1e-12)
        param_moved[n] = diff / max(float((r - initial[n].float()).double().norm()), 1e-12)
    loss_rel = [rel(a, b) for a, b in zip(losses, ref_losses)]
    worst = max(param_rel, key=param_rel.get) if param_rel else None
    finite = all(math.isfinite(v) for v in losses + ref_losses)
    max_loss = max(loss_rel) if loss_rel else float("inf")
    max_param = param_rel[worst] if worst else float("inf")
    passed = bool(finite and not missing and len(losses) == ctx.steps
                  and max_loss <= LOSS_RTOL and max_param <= PARAM_RTOL)
    ref.to("cpu")                    # off the device: the next model's peaks are its own
    if ctx.cuda:
        torch.cuda.empty_cache()
    ctx.models[key].update(peak=peak, ref_peak=ref_peak, median_step_s=statistics.median(steps_s[1:] or steps_s))
    nparams = sum(p.numel() for p in ref.parameters())
    log(f"  {key}: {'PASS' if passed else 'FAIL'} max loss diff {max_loss:.2e} (tol {LOSS_RTOL:g}), "
        f"max param diff {max_param:.2e} (tol {PARAM_RTOL:g}, {worst})")
    compiled = pm.compile_report() if extra.get("compile") else None
    return {"passed": passed, "plan_source": source, "parallelize_s": t_par, "params": nparams,
            "compile_report": compiled, "summary": pm.plan.summary(),
            "mesh": list(pm.plan.mesh_shape), "cluster": pm.plan.cluster,
            "losses": losses, "ref_losses": ref_losses, "loss_rel_diff": loss_rel,
            "max_loss_rel_diff": max_loss, "max_loss_abs_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "max_param_rel_diff": max_param, "worst_param": worst,
            "max_param_diff_rel_to_change": max(param_moved.values()) if param_moved else None,
            "param_rel_diff": param_rel, "missing_params": missing, "finite": finite,
            "step_s": steps_s, "ref_step_s": ref_steps_s,
            "median_step_s": statistics.median(steps_s[1:] or steps_s),
            "median_ref_step_s": statistics.median(ref_steps_s[1:] or ref_steps_s)}


def section_equivalence(ctx: Ctx) -> dict:
    out = {"tolerance": {"loss_rtol": LOSS_RTOL, "param_rtol": PARAM_RTOL,
                         "why": "bf16 autocast in both runs: activations rounded to 8 significant bits "
                                "(unit roundoff 2^-8 = 3.9e-3), kernels may sum in other orders "
                                "(atomics in attention / embedding backward); fp32 master weights"},
           "steps": ctx.steps, "optimizer": f"SGD lr={LR} momentum={MOMENTUM}",
           "precision": "bf16 (autopar precision='bf16'; eager torch.autocast bfloat16)",
           "device": str(ctx.device), "models": {}}
    for name in ("gpt", "llama"):
        if ctx.budget.left() < 20:
            out["models"][name] = {"skipped": "time budget spent"}
            continue
        try:
            out["models"][name] = train_and_compare(ctx, name)
        except Exception as e:  # noqa: BLE001 - recorded, the next model runs
            out["models"][name] = error_info(e)
            log(f"  {name}: ERROR {out['models'][name]['error'][:300]}")
    out["passed"] = all(m.get("passed") for m in out["models"].values())
    return out


# ---- section: per-op timing --------------------------------------------------------------------
def _gemm_key(shapes: list[tuple]) -> tuple | None:
    """(batch, M, K, N) of a GEMM as dispatched (mm, addmm, bmm, baddbmm)."""
    mats = [s for s in shapes if len(s) >= 2]
    if len(mats) < 2:
        return None
    a, b = mats[-2], mats[-1]
    return (math.prod(a[:-2]) if len(a) > 2 else 1, a[-2], a[-1], b[-1])


def _node_sig(desc: dict) -> tuple:
    """(batch, M, K, N) of a graph matmul node at its local shapes."""
    name = desc["op"].split(".")[1]
    ins = [s for s, _ in desc["inputs"]]
    out = desc["outputs"][0][0]
    if name == "linear":
        x, w = ins[0], ins[1]
        return (1, math.prod(x[:-1]), x[-1], w[0])
    a = ins[1] if name in ("addmm", "baddbmm") else ins[0]
    return (math.prod(out[:-2]) if len(out) > 2 else 1, out[-2] if len(out) >= 2 else 1, a[-1], out[-1])


def in_backward() -> bool:
    """Whether the autograd engine is running a backward node now (on a GPU it runs them
    on its own thread)."""
    current = getattr(torch._C, "_current_autograd_node", None)
    if current is not None:
        return current() is not None
    import threading
    return threading.current_thread() is not threading.main_thread()


def make_sync_timer(device: torch.device, store: list):
    """An ``OpTimer`` (``autopar.runtime.timing``: on a GPU it synchronises the device around
    every op, so each op's time is its kernels', not its launch's) that also sums the matmul
    and attention ops by phase (forward / backward) and input shapes."""
    from autopar.cost_models import families
    from autopar.runtime.timing import OpTimer

    class SyncOpTimer(OpTimer):
        def __init__(self, *args, **kwargs):
            super().__init__(device)
            self.by_shape: dict = {}
            store.append(self)

        def record(self, func, args, seconds: float) -> str:
            row = super().record(func, args, seconds)
            if row in ("matmul", "attention"):
                phase = "bwd" if in_backward() else "fwd"
                shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
                got = self.by_shape.setdefault((phase, row, families.op_name(func), shapes), [0.0, 0])
                got[0] += seconds
                got[1] += 1
            return row

    return SyncOpTimer


def op_timing_model(ctx: Ctx, name: str) -> dict:
    from autopar.cost_models.hardware import parse_cluster
    from autopar.cost_models.step import optimizer_step_time
    from autopar.runtime import timing as timing_mod
    from gpu_check_ops import plan_ops
    m = ctx.models[name]
    pm = m["pm"]
    timers: list = []
    original = timing_mod.OpTimer
    timing_mod.OpTimer = make_sync_timer(ctx.device, timers)
    try:
        rep = timing_mod.timing_report(pm, (m["x"],), m["y"], steps=ctx.timing_steps,
                                       warmup=ctx.timing_warmup,
                                       optimizer=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM))
    finally:
        timing_mod.OpTimer = original
    timer = timers[-1]
    steps = ctx.timing_steps
    m["timing_peak"], m["timing_peak_source"] = rep.row("peak memory").measured[0], rep.memory_source
    plan_device = parse_cluster(pm.plan.cluster).device
    local_params = sum(p.numel() for p in pm.parameters())
    opt_pred = optimizer_step_time(local_params, plan_device, optimizer="sgd_momentum", mixed=False)
    families_rows = []
    for r in rep.rows:
        if r.kind not in ("compute", "step", "memory"):
            continue
        pred = r.predicted
        note = ""
        if r.name == "optimizer" and pred is None:
            pred, note = opt_pred, "cost_models.step.optimizer_step_time (fp32 SGD momentum, 20 B/param)"
        meas = r.measured[0] if r.measured else None
        families_rows.append({"row": r.name, "kind": r.kind, "predicted": pred, "measured": meas,
                              "ratio": (meas / pred) if pred and meas is not None else None, "note": note})
    # GEMMs by shape and attention by query shape: graph nodes (local shapes, the plan's
    # prices) against the dispatched kernels they became
    ops = plan_ops(pm._cap, pm.plan)
    measured = {k: (v[0] / steps, v[1] / steps) for k, v in timer.by_shape.items()}
    used: set = set()
    gemms: dict[tuple, dict] = {}
    attn: dict[tuple, dict] = {}
    o_kind: dict[tuple, str] = {}
    for o in ops:
        f, b = o["plan_s"]
        if o["family"] == "matmul":
            sig = _node_sig(o)
            o_kind[sig] = o["op"].split(".")[1]
            g = gemms.setdefault(sig, {"shape": "x".join(map(str, sig)), "nodes": [], "count": 0,
                                       "predicted_fwd_s": 0.0, "predicted_bwd_s": 0.0})
        else:
            sig = tuple(o["inputs"][0][0])
            g = attn.setdefault(sig, {"shape": "x".join(map(str, sig)), "nodes": [], "count": 0,
                                      "predicted_fwd_s": 0.0, "predicted_bwd_s": 0.0})
        g["nodes"].append(o["node"])
        g["count"] += o["members"]
        g["predicted_fwd_s"] += f * o["members"]
        g["predicted_bwd_s"] += b * o["members"]
    for sig, g in gemms.items():
        B, M, K, N = sig
        # backward as autograd dispatches it: linear's grad input g @ W (M x N x K) and grad
        # weight g^T @ x (N x M x K); a batched matmul's g @ b^T (M x N x K), a^T @ g (K x M x N)
        fwd_keys = {(B, M, K, N)}
        bwd_keys = {(B, M, N, K), (B, N, M, K) if o_kind[sig] == "linear" else (B, K, M, N)}
        g["measured_fwd_s"] = g["measured_bwd_s"] = 0.0
        g["calls_fwd"] = g["calls_bwd"] = 0.0
        for k, (s, c) in measured.items():
            phase, fam, _, shapes = k
            if fam != "matmul" or k in used:
                continue
            key = _gemm_key(list(shapes))
            if (phase == "fwd" and key in fwd_keys) or (phase == "bwd" and key in bwd_keys):
                used.add(k)
                g[f"measured_{phase}_s"] += s
                g[f"calls_{phase}"] += c
    for sig, g in attn.items():
        g["measured_fwd_s"] = g["measured_bwd_s"] = 0.0
        for k, (s, c) in measured.items():
            phase, fam, _, shapes = k
            if fam == "attention" and k not in used and sig in shapes:
                used.add(k)
                g[f"measured_{phase}_s"] += s
    for g in list(gemms.values()) + list(attn.values()):
        for p in ("fwd", "bwd"):
            pr, me = g[f"predicted_{p}_s"], g[f"measured_{p}_s"]
            g[f"ratio_{p}"] = me / pr if pr > 0 and me > 0 else None
    unmatched = [{"phase": k[0], "family": k[1], "op": k[2], "shapes": [list(s) for s in k[3]],
                  "seconds_per_step": v[0], "calls_per_step": v[1]}
                 for k, v in measured.items() if k not in used]
    return {"timing_report": str(rep), "timing_report_dict": rep.to_dict(), "families": families_rows,
            "gemm_by_shape": sorted(gemms.values(), key=lambda g: -g["predicted_fwd_s"] - g["predicted_bwd_s"]),
            "attention": list(attn.values()), "unmatched_kernels": unmatched,
            "optimizer_predicted_s": opt_pred, "local_params": local_params,
            "plan_device": plan_device.name,
            "note": "measured per op between two device synchronisations (a launch and two syncs "
                    "each, as the cost model's launch_overhead counts one launch); sums per step, "
                    f"median step of {steps} for the families, mean of {steps} steps by shape"}


def section_op_timing(ctx: Ctx) -> dict:
    out = {"models": {}}
    for name in ("gpt", "llama"):
        if name not in ctx.models:
            out["models"][name] = {"skipped": "no trained module (equivalence section failed for it)"}
            continue
        if ctx.budget.left() < 15:
            out["models"][name] = {"skipped": "time budget spent"}
            continue
        try:
            out["models"][name] = op_timing_model(ctx, name)
            log(f"  {name}:\n" + out["models"][name]["timing_report"])
        except Exception as e:  # noqa: BLE001
            out["models"][name] = error_info(e)
            log(f"  {name}: ERROR {out['models'][name]['error'][:300]}")
    return out


# ---- section: plan_quality shapes ----------------------------------------------------------------
def dry_pick(shapes: list[dict]) -> list[dict]:
    """Three shapes of other kinds (a linear, a batched matmul, an attention), made small."""
    from gpu_check_ops import scaled
    picked, seen = [], set()
    for s in shapes:
        kind = s["op"].split(".")[1]
        if kind not in seen:
            seen.add(kind)
            picked.append(scaled(s))
        if len(picked) == 3:
            break
    return picked


def section_plan_shapes(ctx: Ctx) -> dict:
    from gpu_check_ops import backward_flops, op_bytes, synth_predict, time_op
    if ctx.data is None:
        return {"status": "error", "error": f"{DATA.relative_to(ROOT)} is missing: run "
                                            "`python benchmarks/gpu_check.py --prepare` on a CPU with OR-Tools"}
    shapes = dry_pick(ctx.data["shapes"]) if ctx.dry else ctx.data["shapes"]
    reps, warmup = (3, 1) if ctx.dry else (10, 3)
    key = ctx.dev_key if ctx.cuda else None
    results, skipped = [], []
    for i, s in enumerate(shapes):
        if ctx.budget.left() < 25:
            skipped.append({"id": s["id"], "skipped": "time budget spent"})
            continue
        if ctx.cuda:
            free, _ = torch.cuda.mem_get_info(ctx.device)
            if op_bytes(s) > 0.6 * free:
                skipped.append({"id": s["id"], "skipped": f"needs {op_bytes(s) / 2**30:.1f} GiB, "
                                                          f"{free / 2**30:.1f} GiB free"})
                continue
        r = {"id": s["id"], "op": s["op"], "family": s["family"], "inputs": s["inputs"],
             "flags": s["flags"], "rows": sorted({x["row"] for x in s.get("rows", [])})}
        try:
            m = time_op(s, ctx.device, torch.bfloat16, reps, warmup)
            r.update(measured_fwd_s=m["fwd_s"], measured_bwd_s=m["bwd_s"])
            stored = s["predicted"].get(key) if key else None
            synth = synth_predict(s, ctx.cost_device)
            pf, pb = stored if stored else synth
            r.update(predicted_fwd_s=pf, predicted_bwd_s=pb,
                     predicted_source=f"prepared node_time for {key}" if stored else
                     f"node_time on {ctx.cost_device.name}",
                     predicted_here_fwd_s=synth[0], predicted_here_bwd_s=synth[1],
                     predicted_by_gpu=s["predicted"],
                     ratio_fwd=m["fwd_s"] / pf if pf else None, ratio_bwd=m["bwd_s"] / pb if pb else None,
                     tflops_fwd=s["flops_fwd"] / m["fwd_s"] / 1e12,
                     tflops_bwd=backward_flops(s) / m["bwd_s"] / 1e12,
                     predicted_tflops_fwd=s["flops_fwd"] / pf / 1e12 if pf else None)
            log(f"  [{i + 1}/{len(shapes)}] {s['id']}: fwd {m['fwd_s'] * 1e3:.3f} ms "
                f"(pred {pf * 1e3:.3f}, {r['ratio_fwd']:.2f}x, {r['tflops_fwd']:.0f} TFLOP/s), "
                f"bwd {m['bwd_s'] * 1e3:.3f} ms (pred {pb * 1e3:.3f}, {r['ratio_bwd']:.2f}x)")
        except Exception as e:  # noqa: BLE001 - recorded per shape
            r.update(error_info(e))
            log(f"  {s['id']}: ERROR {r['error'][:200]}")
        finally:
            if ctx.cuda:
                torch.cuda.empty_cache()
        results.append(r)
    ok = [r for r in results if r.get("ratio_fwd") and r.get("ratio_bwd")]
    by_fam = {}
    for fam in ("matmul", "attention"):
        rs = [r for r in ok if r["family"] == fam]
        if rs:
            by_fam[fam] = {"shapes": len(rs), "median_ratio_fwd": statistics.median(r["ratio_fwd"] for r in rs),
                           "median_ratio_bwd": statistics.median(r["ratio_bwd"] for r in rs)}
    rows = []
    if not ctx.dry:
        ratio = {r["id"]: (r["measured_fwd_s"] + r["measured_bwd_s"]) / (r["predicted_fwd_s"] + r["predicted_bwd_s"])
                 for r in ok}
        for row in ctx.data["rows"]:
            timed = [o for o in row["ops"] if o["id"] in ratio]
            share = sum(o["share"] for o in timed)
            rows.append({"row": row["row"], "run": row["run"], "free_plan": row["free_plan"],
                         "gain_recorded": row["gain_recorded"], "timed_share": share,
                         "measured_over_predicted": (sum(o["share"] * ratio[o["id"]] for o in timed) / share)
                         if share else None})
    return {"shapes": results, "skipped_shapes": skipped, "by_family": by_fam, "rows": rows,
            "predicted_for": key or ctx.cost_device.name,
            "method": f"bf16 inputs, CUDA events (perf_counter on CPU), {warmup} warm-up then median of {reps}; "
                      "backward = torch.autograd.grad of every input; predicted = cost_models.compute.node_time "
                      "of the plan's node at its local shapes (prepared) or of the same call rebuilt here",
            "rows_note": "per plan_quality row: measured/predicted of its timed shapes, weighted by their "
                         "share of the row's predicted matmul+attention time (timed_share of it timed)"}


# ---- section: memory -------------------------------------------------------------------------
def section_memory(ctx: Ctx) -> dict:
    out = {"source": "torch.cuda.max_memory_allocated over the equivalence run's steps, less what was "
                     "allocated before parallelize (an earlier model's module)" if ctx.cuda
           else "not measured on a CPU (no caching allocator)",
           "timing_report_note": "timing_report's peak is one step's allocator peak, with every module "
                                 "then resident on the device (on a CPU: live tensors of this module)",
           "models": {}}
    for name in ("gpt", "llama"):
        m = ctx.models.get(name)
        if m is None:
            out["models"][name] = {"skipped": "no trained module (equivalence section failed for it)"}
            continue
        est = m["pm"].plan.estimate
        r = {"estimate_bytes": est.memory_total, "estimate_terms": dict(est.memory_bytes),
             "peak_bytes": m["peak"], "eager_peak_bytes": m["ref_peak"], "resident_before_bytes": m["resident"],
             "ratio": m["peak"] / est.memory_total if m["peak"] and est.memory_total else None,
             "timing_report_peak_bytes": m.get("timing_peak"), "timing_report_peak_source": m.get("timing_peak_source"),
             "timing_report_ratio": m["timing_peak"] / est.memory_total if m.get("timing_peak") else None}
        out["models"][name] = r
        if m["peak"]:
            log(f"  {name}: peak {m['peak'] / 2**20:.1f} MiB against the estimate "
                f"{est.memory_total / 2**20:.1f} MiB ({r['ratio']:.2f}x); eager {m['ref_peak'] / 2**20:.1f} MiB")
    return out


# ---- section: activation offload ---------------------------------------------------------------
def section_offload(ctx: Ctx) -> dict:
    """``offload_activations="full"`` at world 1: each layer's saved tensors go to pinned
    host memory on a side stream in forward and come back, prefetched a layer ahead, for
    its backward (``autopar/ops/host_activations.py``; on a CPU every saved tensor still
    goes through the hooks). Equal to one device as in 1., its peak memory against the
    plan's estimate (issue 44: within 15%) and against the same model without offload (the
    equivalence section's run), and its step against that run's."""
    out = {"models": {}}
    for name in ("gpt", "llama"):
        key = f"{name}-offload"
        if ctx.budget.left() < (20 if out["models"] else 0):
            out["models"][name] = {"skipped": "time budget spent"}
            continue
        try:
            r = train_and_compare(ctx, name, key=key, offload_activations="full")
        except Exception as e:  # noqa: BLE001 - recorded, the next model runs
            out["models"][name] = error_info(e)
            log(f"  {name} offload: ERROR {out['models'][name]['error'][:300]}")
            continue
        m, base = ctx.models[key], ctx.models.get(name, {})
        est = m["pm"].plan.estimate
        r.update(offloaded=m["pm"].plan.options.get("offload_activations"),
                 estimate_bytes=est.memory_total, estimate_terms=dict(est.memory_bytes),
                 peak_bytes=m["peak"], predicted_step_s=est.step_time_s)
        if m["peak"]:
            r["peak_over_estimate"] = m["peak"] / est.memory_total
        if base.get("pm") is not None:
            b_est = base["pm"].plan.estimate
            r.update(without_offload={"estimate_bytes": b_est.memory_total, "peak_bytes": base.get("peak"),
                                      "median_step_s": base.get("median_step_s"),
                                      "predicted_step_s": b_est.step_time_s})
            r["estimate_saved_bytes"] = b_est.memory_total - est.memory_total
            if base.get("peak") and m["peak"]:
                r["peak_saved_bytes"] = base["peak"] - m["peak"]
            if base.get("median_step_s"):
                r["step_over_without"] = r["median_step_s"] / base["median_step_s"]
        del m["pm"]
        if ctx.cuda:
            torch.cuda.empty_cache()
        log(f"  {name} offload: {'PASS' if r['passed'] else 'FAIL'}; peak "
            + (f"{m['peak'] / 2**20:.1f} MiB against the estimate {est.memory_total / 2**20:.1f} MiB "
               f"({r['peak_over_estimate']:.2f}x)" if m["peak"] else "not measured (CPU)")
            + f"; step {r['median_step_s'] * 1e3:.2f} ms ({r.get('step_over_without', float('nan')):.2f}x without)")
        out["models"][name] = r
    return out


# ---- section: compile (a subprocess) ------------------------------------------------------------
def run_worker(args: list[str], timeout: float, torchrun: int = 0, env_extra: dict | None = None) -> dict:
    """This script as ``--worker ...`` in a subprocess (under torchrun with ``torchrun``
    processes, ``env_extra`` added to its environment), its JSON result, or the error and
    the tail of its output."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable]
        if torchrun:
            cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}"]
        cmd += [str(Path(__file__).resolve()), *args, "--out", str(out)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        env.update(env_extra or {})
        log_path = Path(tmp) / "output.txt"
        with open(log_path, "w") as f:
            # a session of its own: on a timeout the whole group goes (torchrun's ranks too)
            p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = p.wait(timeout=max(timeout, 5))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rc = 124
        keep = 16000 if torchrun else 4000          # several ranks' tracebacks
        tail = ((f"timed out after {timeout:.0f} s\n" if rc == 124 else "")
                + log_path.read_text(errors="replace")[-keep:])
        if out.exists():
            got = json.loads(out.read_text())
            got["returncode"] = rc
            if rc == 124:
                got.update(status="error", error=f"timed out after {timeout:.0f} s (what it had finished is kept)")
            if rc not in (0, 124) or got.get("status") == "error":
                got["output_tail"] = tail.splitlines()[-(150 if torchrun else 30):]
            return got
        return {"status": "error", "error": f"worker exited {rc} without a result",
                "output_tail": tail.splitlines()[-(150 if torchrun else 30):], "returncode": rc}


def section_compile(ctx: Ctx) -> dict:
    backend = ctx.args.compile_backend or ("aot_eager" if ctx.dry else "inductor")
    timeout = min(ctx.budget.left() - 10, 300)
    models = "gpt" if ctx.dry else "gpt,llama,mixtral"
    out = run_worker(["--worker", "compile", "--size", ctx.size, "--compile-backend", backend,
                      "--compile-models", models] + (["--dry"] if ctx.dry else []), timeout)
    out["backend"] = backend
    if "gpt" in ctx.models:
        out["autopar_eager_step_s"] = ctx.models["gpt"].get("timing_step_s")
    for name, r in (out.get("models") or {}).items():
        if r.get("compiled_step_s"):
            log(f"  {name}: eager {r['eager_step_s'] * 1e3:.2f} ms, compiled ({backend}) "
                f"{r['compiled_step_s'] * 1e3:.2f} ms ({r['eager_step_s'] / r['compiled_step_s']:.2f}x), "
                f"first compiled step {r['first_compiled_step_s']:.1f} s")
        else:
            log(f"  {name} compile: {r.get('error', out.get('error', '?'))[:300]}")
    return out


def worker_compile(args) -> dict:
    """Eager single-device training steps of each model of ``--compile-models`` against
    ``torch.compile`` of it; the GPT's figures also at the top level (earlier reports')."""
    from gpu_check_ops import batches, build_model
    dev = torch.device("cuda", 0) if torch.cuda.is_available() and not args.dry else torch.device("cpu")
    n, warm = (2, 1) if args.dry else (10, 3)
    res = {"status": "ok", "device": str(dev), "steps": n, "warmup": warm, "models": {}}
    for name in args.compile_models.split(","):
        model, loss_fn, batch, seq, vocab = build_model(name, args.size)
        data = batches(n + warm + 1, batch, seq, vocab)
        r = res["models"][name] = {}

        def run(m, label):
            times, losses = eager_steps(m.to(dev), data, loss_fn, dev)
            r[f"{label}_first_step_s"] = times[0]
            r[f"{label}_step_s"] = statistics.median(times[1 + warm:])
            r[f"{label}_losses"] = losses
            return times

        run(copy.deepcopy(model), "eager")
        args.out.write_text(json.dumps(res, indent=1, default=_json_default))    # kept if compiling hangs
        try:
            t = run(torch.compile(copy.deepcopy(model), backend=args.compile_backend), "compiled")
            r["first_compiled_step_s"] = t[0]
            r["speedup"] = r["eager_step_s"] / r["compiled_step_s"]
            r["max_loss_rel_diff_compiled_vs_eager"] = max(rel(a, b) for a, b in zip(r["compiled_losses"],
                                                                                     r["eager_losses"]))
        except Exception as e:  # noqa: BLE001 - a compile failure is a result
            r.update(status="error", **error_info(e))
            if name == "gpt":
                res.update(status="error", **error_info(e))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    res.update({k: v for k, v in res["models"].get("gpt", {}).items() if k != "status"})
    return res


# ---- section: attention by SDPA backend -----------------------------------------------------------
ATTENTION_SHAPES = {
    "gpu": [(1, 64, 8192, 128), (1, 32, 8192, 128), (2, 32, 4096, 128), (4, 32, 2048, 128),
            (8, 12, 512, 64), (1, 32, 16384, 128)],
    "dry": [(1, 2, 64, 32)],
}
"""(batch, heads, sequence, head dim) of causal attention timed under each backend: the
plan_quality shapes (8,192 tokens, 128-dim heads), shorter sequences at the same tokens,
the check's GPT, and a long sequence (the context-parallel range)."""


def section_attention_backends(ctx: Ctx) -> dict:
    """Causal ``F.scaled_dot_product_attention`` in bf16, forward and backward, under each
    of torch's SDPA backends (FlashAttention-2, cuDNN, memory-efficient) and under torch's
    default choice, against the cost model's fused-attention prediction for this GPU
    (``Device.attention_efficiency``): which backend torch runs by default here, and at
    what fraction of the dense peak."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from gpu_check_ops import synth_predict, time_op
    backends = {"default": None}
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        if hasattr(SDPBackend, name):
            backends[name.lower()] = getattr(SDPBackend, name)
    reps, warmup = (3, 1) if ctx.dry else (10, 3)
    peak = ctx.cost_device.peak_flops["bf16"]
    out = {"peak_bf16_flops": peak, "cost_model_attention_efficiency": list(ctx.cost_device.attention_efficiency or ()),
           "flops": "causal: forward 2*B*H*S^2*D (half of 4*B*H*S^2*D), backward 2.5x forward", "shapes": []}
    for b, h, sq, d in ATTENTION_SHAPES[ctx.size]:
        desc = {"op": "aten.scaled_dot_product_attention.default", "family": "attention",
                "inputs": [[[b, h, sq, d], "bfloat16"]] * 3, "outputs": [[[b, h, sq, d], "bfloat16"]],
                "flags": {"is_causal": True}, "dtype_key": "bf16", "native": True}
        flops_f = 2 * b * h * sq * sq * d
        row = {"shape": [b, h, sq, d], "flops_fwd": flops_f, "backends": {}}
        try:
            pf, pb = synth_predict(desc, ctx.cost_device)
            row.update(predicted_fwd_s=pf, predicted_bwd_s=pb)
        except Exception as e:  # noqa: BLE001
            row["predicted"] = error_info(e)
            pf = pb = None
        for label, be in backends.items():
            if ctx.budget.left() < 20:
                row["backends"][label] = {"skipped": "time budget spent"}
                continue
            try:
                if be is None:
                    m = time_op(desc, ctx.device, torch.bfloat16, reps, warmup)
                else:
                    with sdpa_kernel([be]):
                        m = time_op(desc, ctx.device, torch.bfloat16, reps, warmup)
                r = {"fwd_s": m["fwd_s"], "bwd_s": m["bwd_s"],
                     "efficiency_fwd": flops_f / m["fwd_s"] / peak, "efficiency_bwd": 2.5 * flops_f / m["bwd_s"] / peak}
                if pf and pb:
                    r.update(ratio_fwd=m["fwd_s"] / pf, ratio_bwd=m["bwd_s"] / pb)
            except Exception as e:  # noqa: BLE001 - a backend that cannot run this shape here
                r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            finally:
                if ctx.cuda:
                    torch.cuda.empty_cache()
            row["backends"][label] = r
        got = {k: v for k, v in row["backends"].items() if "fwd_s" in v}
        if "default" in got:
            others = {k: v for k, v in got.items() if k != "default"}
            if others:     # the backend whose time the default's is nearest
                d0 = got["default"]
                row["default_is"] = min(others, key=lambda k: abs(others[k]["fwd_s"] - d0["fwd_s"])
                                        + abs(others[k]["bwd_s"] - d0["bwd_s"]))
        log(f"  {b}x{h}x{sq}x{d}: " + ", ".join(
            f"{k} {v['efficiency_fwd']:.2f}/{v['efficiency_bwd']:.2f}" if "fwd_s" in v else f"{k} -"
            for k, v in row["backends"].items()) + f" of peak (fwd/bwd); default ~ {row.get('default_is')}")
        out["shapes"].append(row)
    return out


def section_fp8_gemms(ctx: Ctx) -> dict:
    """``precision="fp8"``'s linear timed against its price (``gpu_check_fp8``)."""
    from gpu_check_fp8 import section_fp8_gemms as run
    return run(ctx)


# ---- sections: a mixture of experts; autopar's compiled programs ------------------------------
def section_moe(ctx: Ctx) -> dict:
    """transformers' Mixtral (top-2 of 8 experts) trained as the equivalence section trains
    the GPT: each MoE layer one ``autopar::moe_experts`` op running the experts class's own
    forward on this device."""
    out = train_and_compare(ctx, "mixtral")
    out["experts"] = [line for line in out["summary"].splitlines() if "expert" in line.lower()]
    return out


def section_autopar_compile(ctx: Ctx) -> dict:
    """The GPT, the Llama, then the Mixtral, through ``parallelize(compile=True)`` (each program through
    ``torch.compile``: Inductor, Triton on a GPU; the experts op opaque in the graph) against
    eager training on one device, and each step against autopar eager's (the same plan,
    trained by the equivalence and moe sections) and, for the GPT, ``torch.compile`` of the
    single-device model (the compile section)."""
    out = {"models": {}}
    # --dry: the GPT only (compiling on 2 CPU cores is slow; tests/test_compile.py compiles
    # the experts op's plans)
    for name in ("gpt",) if ctx.dry else ("gpt", "llama", "mixtral"):
        if ctx.budget.left() < (60 if out["models"] else 0):
            out["models"][name] = {"skipped": "time budget spent"}
            continue
        try:
            r = train_and_compare(ctx, name, key=f"{name}-compiled", compile=True)
        except Exception as e:  # noqa: BLE001 - recorded, the next model runs
            out["models"][name] = error_info(e)
            log(f"  {name} compiled: ERROR {out['models'][name]['error'][:300]}")
            continue
        eager = ctx.models.get(name, {}).get("median_step_s")
        r["autopar_eager_step_s"] = eager
        if eager and r["median_step_s"]:
            r["speedup_over_autopar_eager"] = eager / r["median_step_s"]
        rep = r.get("compile_report") or {}
        log(f"  {name} compiled: step {r['median_step_s'] * 1e3:.2f} ms against autopar eager "
            f"{(eager or float('nan')) * 1e3:.2f} ms; compiled in {sum((rep.get('compile_s') or {}).values()):.1f} s "
            f"(cache hits {rep.get('cache_hits')}, misses {rep.get('cache_misses')})")
        out["models"][name] = r
        out["models"][f"{name}-graphs"] = cuda_graphs_run(ctx, name, r)
    return out


def cuda_graphs_run(ctx: Ctx, name: str, compiled: dict) -> dict:
    """Model ``name`` under ``compile="reduce-overhead"`` (each program replayed as CUDA
    graphs on a GPU; on the CPU of ``--dry`` compile=True's programs, Inductor's cache
    serving them) trained as in 1., its step against ``compile=True``'s (``compiled``) and
    its host time as ``cost_models.host.graphs_dispatches`` prices it (a step of two replays,
    the batch copied in, each gradient rebuilt and accumulated, SGD with momentum's foreach
    calls) beside the measured step."""
    from autopar.cost_models.host import GPU_HOST_OP_S, graphs_dispatches
    if ctx.budget.left() < (0 if ctx.dry else 60):
        return {"skipped": "time budget spent"}
    try:
        r = train_and_compare(ctx, name, key=f"{name}-graphs", compile="reduce-overhead")
    except Exception as e:  # noqa: BLE001 - recorded, the next model runs
        r = error_info(e)
        log(f"  {name} CUDA graphs: ERROR {r['error'][:300]}")
        return r
    pm = ctx.models[f"{name}-graphs"]["pm"]
    params = len({id(p) for p in pm.parameters()})
    r["predicted_host_s"] = graphs_dispatches(2, params, optimizer_states=1) * GPU_HOST_OP_S
    base = compiled.get("median_step_s")
    if base and r.get("median_step_s"):
        r["speedup_over_compiled"] = base / r["median_step_s"]
    log(f"  {name} CUDA graphs: step {r['median_step_s'] * 1e3:.2f} ms against compiled "
        f"{(base or float('nan')) * 1e3:.2f} ms; host priced {r['predicted_host_s'] * 1e3:.2f} ms")
    return r


# ---- section: several GPUs -----------------------------------------------------------------------
def section_multi_gpu(ctx: Ctx) -> dict:
    """``data=2``, ``tensor=2`` and ZeRO-3 of the GPT on 2 ranks (torchrun) against one
    device. With one GPU both ranks share it over gloo (``AUTOPAR_SHARE_GPUS=1``: NCCL
    refuses two ranks on one GPU), so the multi-rank CUDA paths (the autograd engine's device
    thread, streams, CUDA tensors through the collectives) run at least once per loan; its
    times measure gloo through host memory, not a GPU link."""
    from autopar.device import SHARE_GPUS_ENV
    n = torch.cuda.device_count() if ctx.cuda else 0
    shared = ctx.cuda and n < 2
    if ctx.args.multi_cpu:
        n, shared = 2, False
    elif not ctx.cuda:
        return {"status": "skipped", "skipped": "dry run: no GPU"}
    if not HAVE_ORTOOLS:
        return {"status": "skipped", "skipped": f"{n} GPU(s) but no OR-Tools to plan data=2 / tensor=2 / "
                                                f"ZeRO-3 ({ORTOOLS})"}
    out = run_worker(["--worker", "multi", "--size", ctx.size] + (["--dry"] if ctx.dry else []),
                     min(ctx.budget.left() - 5, 400), torchrun=2,
                     env_extra={SHARE_GPUS_ENV: "1"} if shared else None)
    out["gpus"] = n
    out["ranks_share_one_gpu"] = shared
    for label, r in (out.get("plans") or {}).items():
        for loop, v in r.items():
            log(f"  {label} {loop}: " + (f"{'PASS' if v.get('passed') else 'FAIL'} max loss diff "
                                         f"{v['max_loss_rel_diff']:.2e}, step {v['step_s'] * 1e3:.1f} ms"
                                         if "losses" in v else f"ERROR {str(v.get('error'))[:200]}"))
    return out


COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
               "broadcast", "send_recv")
GLOO_CUDA_P2P = ("not probed: gloo's send / recv of a CUDA tensor fails ('writev: Bad address', its TCP "
                 "pair then closed: seen on an H200, torch 2.11, 2026-11-29), and the next collective "
                 "with it")


def probe_collectives(dev: torch.device, progress=lambda what: None) -> dict:
    """Each collective autopar's runtime issues, once on a small tensor of ``dev``: which the
    backend runs ("ok") and the first line of the error of those it does not."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for op in COLLECTIVES:
        if op == "send_recv" and dev.type == "cuda" and dist.get_backend() == "gloo":
            out[op] = GLOO_CUDA_P2P
            continue
        progress(f"probe {op}")
        x = torch.arange(world * 4, dtype=torch.float32, device=dev) + rank
        try:
            if op == "all_reduce":
                dist.all_reduce(x)
            elif op == "all_gather_into_tensor":
                dist.all_gather_into_tensor(torch.empty(world * x.numel(), device=dev), x)
            elif op == "reduce_scatter_tensor":
                dist.reduce_scatter_tensor(torch.empty(4, device=dev), x)
            elif op == "all_to_all_single":
                dist.all_to_all_single(torch.empty_like(x), x)
            elif op == "broadcast":
                dist.broadcast(x, 0)
            else:
                got = torch.empty_like(x)
                for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % world),
                                                 dist.P2POp(dist.irecv, got, (rank - 1) % world)]):
                    w.wait()
            sync(dev)
            out[op] = "ok"
        except Exception as e:  # noqa: BLE001 - what this backend cannot do is the result
            out[op] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        dist.barrier()
    return out


def worker_multi(args) -> dict:
    """On 2 ranks (torchrun): the GPT under data=2, tensor=2 and data=2 + ZeRO-3 against
    one device (each rank trains the eager reference too), each plan trained twice: by
    ``pm.train_step`` and by the ordinary loop (``loss_fn(pm(x), y).backward()``, the
    backward's collectives fired by the autograd engine); then all-reduce bus bandwidth
    against ``cost_models.comm.collective_time`` on this node's link."""
    import autopar
    from autopar.cost_models.comm import collective_time
    from autopar.cost_models.hardware import parse_cluster
    from autopar.cost_models.local_devices import local_cluster
    from autopar.device import backend_for, gpus_shared, rank_device
    from gpu_check_ops import batches, build_model
    dev = rank_device() if not args.dry else torch.device("cpu")
    dist.init_process_group(backend_for(dev))
    world, rank = dist.get_world_size(), dist.get_rank()
    model, loss_fn, batch, seq, vocab = build_model("gpt", args.size)
    steps = 3 if args.dry else 10
    data = batches(steps, batch, seq, vocab)
    res = {"status": "ok", "world": world, "steps": steps, "backend": dist.get_backend(),
           "device": str(dev), "gpus_shared": gpus_shared(), "plans": {}}

    def progress(what: str) -> None:     # what finished is kept if a rank aborts later
        print(f"[rank {rank}] {what}", flush=True)
        if rank == 0:
            args.out.write_text(json.dumps(res, indent=1, default=_json_default))
    progress(f"{res['backend']} on {dev}")
    ref = copy.deepcopy(model).to(dev)
    ref_t, ref_losses = eager_steps(ref, data, loss_fn, dev)
    res["one_device_step_s"] = statistics.median(ref_t[1:] or ref_t)
    res["one_device_losses"] = ref_losses
    del ref
    for label, pins in (("data=2", {"data": 2}), ("tensor=2", {"tensor": 2}),
                        ("data=2 zero=3", {"data": 2, "zero": 3})):
        res["plans"][label] = {}
        for loop in ("train_step", "backward"):
            r = {}
            try:
                pm = autopar.parallelize(copy.deepcopy(model), data[0][:1], loss_fn, target=data[0][1],
                                         precision="bf16", optimizer="sgd_momentum", **pins)
                opt = torch.optim.SGD(pm.parameters(), lr=LR, momentum=MOMENTUM)
                losses, ts = [], []
                for x, y in data:
                    dist.barrier()
                    t = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    if loop == "train_step":
                        loss = pm.train_step(x, target=y)
                        pm.step(opt)
                    else:                # the loop a user has: precision is the plan's
                        loss = loss_fn(pm(x), y.to(dev))
                        loss.backward()
                        opt.step()
                    sync(dev)
                    ts.append(time.perf_counter() - t)
                    losses.append(float(loss.detach()))
                worst = max(rel(a, b) for a, b in zip(losses, ref_losses))
                r = {"losses": losses, "max_loss_rel_diff": worst,
                     "step_s": statistics.median(ts[1:] or ts), "predicted_step_s": pm.plan.estimate.step_time_s,
                     "mesh": list(pm.plan.mesh_shape), "axes": list(pm.plan.mesh_axes),
                     "passed": worst <= LOSS_RTOL}
                r["speedup_vs_one_device"] = res["one_device_step_s"] / r["step_s"]
                del pm, opt
            except Exception as e:  # noqa: BLE001
                r = error_info(e)
            res["plans"][label][loop] = r
            progress(f"{label} {loop}: " + (f"loss diff {r['max_loss_rel_diff']:.1e}" if "losses" in r
                                            else r.get("error", "")[:200]))
    res["collectives"] = probe_collectives(dev, progress)
    cl = local_cluster(world)
    cl = parse_cluster(cl) if isinstance(cl, str) else cl
    bw = []
    for nbytes in ((2**20, 2**22) if args.dry else (2**20, 2**24, 2**27, 2**29)):
        try:
            t = torch.ones(nbytes // 4, device=dev)
            for _ in range(3):
                dist.all_reduce(t)
            sync(dev)
            ts = []
            for _ in range(5 if args.dry else 10):
                dist.barrier()
                sync(dev)
                t0 = time.perf_counter()
                dist.all_reduce(t)
                sync(dev)
                ts.append(time.perf_counter() - t0)
            s = statistics.median(ts)
            pred = collective_time("all_reduce", nbytes, world, cl.intra, skew=False)
            bw.append({"bytes": nbytes, "seconds": s, "busbw_GBps": 2 * (world - 1) / world * nbytes / s / 1e9,
                       "predicted_s": pred,
                       "predicted_busbw_GBps": 2 * (world - 1) / world * nbytes / pred / 1e9 if pred else None})
            del t
        except Exception as e:  # noqa: BLE001
            bw.append({"bytes": nbytes, **error_info(e)})
    res["all_reduce"] = bw
    res["link"] = {"bandwidth": cl.intra.bandwidth, "latency": cl.intra.latency, "cluster": cl.name}
    dist.destroy_process_group()
    return res if rank == 0 else None


# ---- section: one rank of real-scale plans (benchmarks/gpu_check_scale.py) -----------------------
def section_scale(ctx: Ctx) -> dict:
    from gpu_check_scale import section_scale as scale
    return scale(ctx, HAVE_ORTOOLS, log, error_info, init_process_group)


# ---- the report ----------------------------------------------------------------------------------
def run_section(report: dict, ctx: Ctx, name: str, fn, need_s: float, out_path: Path) -> None:
    left = ctx.budget.left()
    if left < need_s:
        report["sections"][name] = {"status": "skipped",
                                    "skipped": f"time budget: {left:.0f} s left of --budget-s "
                                               f"{ctx.budget.total:.0f}, the section needs ~{need_s:.0f} s"}
        log(f"== {name}: skipped (time budget)")
        return
    log(f"== {name}")
    t0 = time.perf_counter()
    try:
        out = fn(ctx)
        out.setdefault("status", "ok")
    except Exception as e:  # noqa: BLE001 - recorded; the next section runs
        out = {"status": "error", **error_info(e)}
        log(f"  ERROR {out['error'][:500]}")
    out["seconds"] = time.perf_counter() - t0
    report["sections"][name] = out
    write(report, out_path)


def write(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=_json_default))
    tmp.replace(path)


def _json_default(o):
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def _f(x, fmt="{:.2f}"):
    return fmt.format(x) if isinstance(x, (int, float)) and x is not None else "-"


def speed_lines(s: dict) -> list[str]:
    """Issue 42's ratios at world 1 (goals <= 1.05 and <= 1.0): autopar eager over torch
    eager, both timed in one process on the same batches (the equivalence and moe
    sections' step against their eager reference's), and autopar ``compile=True`` (the
    autopar_compile section) over ``torch.compile`` of the same model (the compile
    worker, another process: its own eager step is printed beside, to show how far two
    processes' eager steps differ)."""
    torch_runs = (s.get("compile", {}).get("models") or {})
    eager = {**s.get("equivalence", {}).get("models", {}), "mixtral": s.get("moe", {})}
    compiled = s.get("autopar_compile", {}).get("models", {})
    out = []
    for name in ("gpt", "llama", "mixtral"):
        parts, e, t = [], eager.get(name) or {}, torch_runs.get(name) or {}
        if e.get("median_step_s") and e.get("median_ref_step_s"):
            parts.append(f"autopar eager / torch eager {e['median_step_s'] / e['median_ref_step_s']:.2f} "
                         f"({e['median_step_s'] * 1e3:.2f} / {e['median_ref_step_s'] * 1e3:.2f} ms)")
        b = (compiled.get(name) or {}).get("median_step_s")
        if b and t.get("compiled_step_s"):
            parts.append(f"autopar compiled / torch.compile {b / t['compiled_step_s']:.2f} "
                         f"({b * 1e3:.2f} / {t['compiled_step_s'] * 1e3:.2f} ms; that process's eager "
                         f"{t['eager_step_s'] * 1e3:.2f} ms)")
        g = (compiled.get(f"{name}-graphs") or {}).get("median_step_s")
        if b and g:
            parts.append(f"autopar reduce-overhead / autopar compiled {g / b:.2f} ({g * 1e3:.2f} / "
                         f"{b * 1e3:.2f} ms)")
        if parts:
            out.append(f"speed {name}: " + "; ".join(parts))
    return out


def summary(report: dict) -> list[str]:
    s = report["sections"]
    env = s.get("environment", {})
    lines = [f"gpu_check ({report['mode']}) on {env.get('gpu') or report['device']}, torch {env.get('torch')}, "
             f"plans {env.get('plan_source')} ({env.get('ortools')}); {report['elapsed_s']:.0f} s of "
             f"{report['budget_s']:.0f} s"]
    for name, sec in s.items():
        if sec.get("status") == "skipped":
            lines.append(f"{name}: skipped: {sec.get('skipped')}")
        elif sec.get("status") == "error":
            lines.append(f"{name}: ERROR {sec.get('error', '')[:200]}")
    eq = s.get("equivalence", {})
    for name, m in eq.get("models", {}).items():
        if "passed" in m:
            lines.append(f"equivalence {name}: {'PASS' if m['passed'] else 'FAIL'}: max loss diff "
                         f"{m['max_loss_rel_diff']:.2e} (tol {LOSS_RTOL:g}), max param diff "
                         f"{m['max_param_rel_diff']:.2e} (tol {PARAM_RTOL:g}) over {eq['steps']} steps; step "
                         f"{m['median_step_s'] * 1e3:.2f} ms, eager {m['median_ref_step_s'] * 1e3:.2f} ms")
        else:
            lines.append(f"equivalence {name}: {m.get('error') or m.get('skipped')}"[:240])
    for name, m in s.get("op_timing", {}).get("models", {}).items():
        fams = {r["row"]: r for r in m.get("families", [])}
        if fams:
            parts = [f"{k} {_f(r['ratio'])}x" for k, r in fams.items() if r["ratio"] is not None]
            lines.append(f"op timing {name} (measured/predicted): " + ", ".join(parts))
    ps = s.get("plan_shapes", {})
    if ps.get("skipped_shapes"):
        lines.append(f"plan shapes: {len(ps['skipped_shapes'])} not timed ({ps['skipped_shapes'][0]['skipped']}, ...)")
    for fam, v in ps.get("by_family", {}).items():
        lines.append(f"plan shapes {fam}: {v['shapes']} timed, measured/predicted median fwd "
                     f"{v['median_ratio_fwd']:.2f}x, bwd {v['median_ratio_bwd']:.2f}x")
    for r in ps.get("rows", []):
        if r["measured_over_predicted"] is not None:
            lines.append(f"  row {r['row']:>2} {r['run']:<12} gain {r['gain_recorded']:.2f}x: measured/predicted "
                         f"{r['measured_over_predicted']:.2f}x over {r['timed_share']:.0%} of its op time")
    for name, m in s.get("memory", {}).get("models", {}).items():
        if m.get("ratio"):
            lines.append(f"memory {name}: peak {m['peak_bytes'] / 2**20:.1f} MiB vs estimate "
                         f"{m['estimate_bytes'] / 2**20:.1f} MiB ({m['ratio']:.2f}x)")
        elif m.get("timing_report_ratio"):
            lines.append(f"memory {name}: one step's peak ({m['timing_report_peak_source']}) "
                         f"{m['timing_report_peak_bytes'] / 2**20:.2f} MiB vs estimate "
                         f"{m['estimate_bytes'] / 2**20:.2f} MiB ({m['timing_report_ratio']:.2f}x)")
    c = s.get("compile", {})
    for name, r in (c.get("models") or {"gpt": c}).items():
        if r.get("compiled_step_s"):
            lines.append(f"compile {name} ({c.get('backend')}): eager {r['eager_step_s'] * 1e3:.2f} ms, compiled "
                         f"{r['compiled_step_s'] * 1e3:.2f} ms ({r['speedup']:.2f}x), first step "
                         f"{r['first_compiled_step_s']:.1f} s")
    lines += speed_lines(s)
    for name, m in s.get("offload", {}).get("models", {}).items():
        if "passed" in m:
            lines.append(f"offload {name}: {'PASS' if m['passed'] else 'FAIL'}: max loss diff {m['max_loss_rel_diff']:.2e}, "
                         f"max param diff {m['max_param_rel_diff']:.2e}; peak {_f((m.get('peak_bytes') or 0) / 2**20, '{:.1f}')} "
                         f"MiB vs estimate {m['estimate_bytes'] / 2**20:.1f} MiB ({_f(m.get('peak_over_estimate'))}x); "
                         f"without offload peak {_f(((m.get('without_offload') or {}).get('peak_bytes') or 0) / 2**20, '{:.1f}')} "
                         f"MiB; step {_f(m.get('step_over_without'))}x without")
        else:
            lines.append(f"offload {name}: {m.get('error') or m.get('skipped')}"[:240])
    for r in s.get("attention_backends", {}).get("shapes", []):
        parts = [f"{k} {v['efficiency_fwd']:.2f}/{v['efficiency_bwd']:.2f}" for k, v in r["backends"].items()
                 if "fwd_s" in v]
        lines.append(f"attention {'x'.join(map(str, r['shape']))} causal, fraction of peak fwd/bwd: "
                     + ", ".join(parts) + f" (default ~ {r.get('default_is')})")
    m = s.get("moe", {})
    if "passed" in m:
        lines.append(f"moe mixtral: {'PASS' if m['passed'] else 'FAIL'}: max loss diff {m['max_loss_rel_diff']:.2e}, "
                     f"max param diff {m['max_param_rel_diff']:.2e} over {len(m['losses'])} steps; step "
                     f"{m['median_step_s'] * 1e3:.2f} ms, eager {m['median_ref_step_s'] * 1e3:.2f} ms")
    for name, m in s.get("autopar_compile", {}).get("models", {}).items():
        if "passed" not in m:
            lines.append(f"autopar compile=True {name}: {m.get('error') or m.get('skipped')}"[:240])
            continue
        if name.endswith("-graphs"):
            lines.append(f"autopar compile='reduce-overhead' {name}: {'PASS' if m['passed'] else 'FAIL'}: "
                         f"max loss diff {m['max_loss_rel_diff']:.2e}; step {m['median_step_s'] * 1e3:.2f} ms "
                         f"({_f(m.get('speedup_over_compiled'))}x compile=True's), host priced "
                         f"{m['predicted_host_s'] * 1e3:.2f} ms")
            continue
        lines.append(f"autopar compile=True {name}: {'PASS' if m['passed'] else 'FAIL'}: max loss diff "
                     f"{m['max_loss_rel_diff']:.2e}, max param diff {m['max_param_rel_diff']:.2e}; step "
                     f"{m['median_step_s'] * 1e3:.2f} ms against autopar eager "
                     f"{_f((m.get('autopar_eager_step_s') or 0) * 1e3)} ms "
                     f"({_f(m.get('speedup_over_autopar_eager'))}x), one-device eager "
                     f"{m['median_ref_step_s'] * 1e3:.2f} ms")
    mg = s.get("multi_gpu", {})
    where = "2 ranks on 1 GPU (gloo)" if mg.get("ranks_share_one_gpu") else "multi-gpu"
    if mg.get("collectives"):
        lines.append(f"{where} collectives on {mg.get('device')}: " + ", ".join(
            f"{k} {'ok' if v == 'ok' else 'FAILED (' + v[:80] + ')'}" for k, v in mg["collectives"].items()))
    for label, loops in (mg.get("plans") or {}).items():
        for loop, r in loops.items():
            lines.append(f"{where} {label} {loop}: " + (
                f"{'PASS' if r['passed'] else 'FAIL'} loss diff {r['max_loss_rel_diff']:.1e}, step "
                f"{r['step_s'] * 1e3:.2f} ms (predicted {r['predicted_step_s'] * 1e3:.2f}), "
                f"{r['speedup_vs_one_device']:.2f}x one device" if "step_s" in r
                else f"ERROR {str(r.get('error'))[:160]}"))
    from gpu_check_scale import summary_lines
    lines += summary_lines(s.get("scale", {}))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="on the CPU at tiny sizes (gloo, 2 steps)")
    ap.add_argument("--prepare", action="store_true",
                    help=f"compute {DATA.relative_to(ROOT)} here (needs OR-Tools)")
    ap.add_argument("--prepare-scale", action="store_true",
                    help="solve the scale section's real-scale plans here (needs OR-Tools)")
    ap.add_argument("--out", type=Path, default=None, help="the JSON report")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip what would start after this")
    ap.add_argument("--steps", type=int, default=20, help="training steps of the equivalence check")
    ap.add_argument("--plans", choices=("auto", "live", "saved"), default="auto",
                    help="auto: solve where OR-Tools imports, else the prepared plans")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend (default inductor; aot_eager with --dry)")
    ap.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    ap.add_argument("--multi-cpu", action="store_true", help=argparse.SUPPRESS)   # test the 2-rank path on gloo
    ap.add_argument("--worker", choices=("compile", "multi"), help=argparse.SUPPRESS)
    ap.add_argument("--size", default="gpu", help=argparse.SUPPRESS)
    ap.add_argument("--compile-models", default="gpt", help=argparse.SUPPRESS)
    ap.add_argument("--scale-cases", default="", help="comma-separated cases of the scale section (default: all)")
    args = ap.parse_args(argv)

    if args.worker:
        res = worker_compile(args) if args.worker == "compile" else worker_multi(args)
        if res is not None:
            args.out.write_text(json.dumps(res, indent=1, default=_json_default))
        return 0
    if args.prepare:
        return prepare(args)
    if args.prepare_scale:
        if not HAVE_ORTOOLS:
            print(f"--prepare-scale needs OR-Tools ({ORTOOLS})", file=sys.stderr)
            return 2
        from gpu_check_scale import prepare as prepare_scale
        return prepare_scale(log)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry:
        print("gpu_check: no CUDA GPU present (torch.cuda.is_available() is False): nothing to "
              "check here. Run it on a GPU machine, or with --dry to exercise it on the CPU.",
              file=sys.stderr, flush=True)
        return 2
    if args.dry:
        log("no CUDA GPU present: dry run on CPU" if not GPU_HIDDEN else
            "--dry: dry run on CPU (a GPU is present and hidden from this run)")
    out_path = args.out or (Path(tempfile.gettempdir()) / f"gpu_check_dry_{os.getpid()}.json" if args.dry
                            else RESULTS / f"gpu_check_{slug(torch.cuda.get_device_name(0))}.json")
    ctx = Ctx(args)
    report = {"schema": "autopar-gpu-check/1", "mode": "dry" if args.dry else "gpu",
              "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": str(ctx.device),
              "budget_s": args.budget_s, "argv": sys.argv[1:], "sections": {}}
    backend = init_process_group(ctx.device)
    report["process_group"] = f"{backend}, world 1, in this process"
    log(f"process group: {report['process_group']}; report: {out_path}")
    # what no earlier loan ran first (offload, two ranks), then the rest
    sections = [("environment", section_environment, 0), ("equivalence", section_equivalence, 30),
                ("offload", section_offload, 20), ("multi_gpu", section_multi_gpu, 30),
                ("op_timing", section_op_timing, 20), ("plan_shapes", section_plan_shapes, 25),
                ("memory", section_memory, 0), ("fp8_gemms", section_fp8_gemms, 20),
                ("moe", section_moe, 30), ("compile", section_compile, 60),
                ("autopar_compile", section_autopar_compile, 60),
                ("attention_backends", section_attention_backends, 30), ("scale", section_scale, 60)]
    only = {s for s in args.only.split(",") if s}
    for name, fn, need in sections:
        if only and name not in only and name not in ("environment", "equivalence"):
            continue
        run_section(report, ctx, name, fn, 0 if args.dry else need, out_path)
        if name == "op_timing" and "gpt" in ctx.models:
            g = report["sections"]["op_timing"].get("models", {}).get("gpt", {})
            ctx.models["gpt"]["timing_step_s"] = next((r["measured"] for r in g.get("families", [])
                                                       if r["row"] == "step"), None)
    report["elapsed_s"] = time.perf_counter() - T0
    report["summary"] = summary(report)
    write(report, out_path)
    print("\n".join(["", "---- summary ----", *report["summary"], f"report: {out_path}"]), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def dump_lines(data: dict) -> str:
    """JSON with one top-level key a line, one list item a line (rows, shapes) and one plan
    a line: small to commit, readable in a diff."""
    c = lambda v: json.dumps(v, separators=(",", ":"), default=_json_default)  # noqa: E731
    parts = []
    for k, v in data.items():
        if isinstance(v, list) and v:
            parts.append(f"{c(k)}: [\n  " + ",\n  ".join(c(x) for x in v) + "\n ]")
        elif k == "plans" and isinstance(v, dict):
            sizes = []
            for size, by_key in v.items():
                keys = []
                for key, by_name in by_key.items():
                    names = [f"{c(name)}: {c(p)}" for name, p in by_name.items()]
                    keys.append(f"{c(key)}: {{\n    " + ",\n    ".join(names) + "}")
                sizes.append(f"{c(size)}: {{\n   " + ",\n   ".join(keys) + "}")
            parts.append(f"{c(k)}: {{\n  " + ",\n  ".join(sizes) + "}")
        else:
            parts.append(f"{c(k)}: {c(v)}")
    return "{\n " + ",\n ".join(parts) + "\n}\n"


def prepare(args) -> int:
    """``--prepare``: the plan_quality shapes and the world-1 plans, into ``DATA``."""
    if not HAVE_ORTOOLS:
        print(f"--prepare needs OR-Tools ({ORTOOLS})", file=sys.stderr)
        return 2
    from gpu_check_ops import GPU_KEYS, MAX_SHAPES, MODELS, SHAPE_LAYERS, prepare_plans, prepare_shapes
    log("plan_quality free-plan shapes")
    shapes = prepare_shapes(log=lambda m, **_: log(m))
    log("world-1 plans")
    plans = prepare_plans(log=lambda m, **_: log(m))
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    import transformers
    data = {"what": "inputs of benchmarks/gpu_check.py, made by `python benchmarks/gpu_check.py --prepare` on a "
                    "CPU with OR-Tools: the matmul/attention ops of benchmarks/plan_quality.py's free plans "
                    f"(each row's model with {SHAPE_LAYERS} layers at a rank's micro-batch, planned with its "
                    "tensor degree; gpu_check_ops.FREE_PLANS), at most "
                    f"{MAX_SHAPES} shapes, with cost_models.compute.node_time's (forward, backward) seconds on "
                    f"{', '.join(GPU_KEYS)} in bf16; and world-1 plans of the check's two models",
            "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit,
            "torch": torch.__version__, "transformers": transformers.__version__, "models": MODELS,
            **shapes, "plans": plans}
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(dump_lines(data))
    log(f"wrote {DATA.relative_to(ROOT)} ({DATA.stat().st_size / 1024:.0f} KiB): {len(shapes['shapes'])} shapes "
        f"of {len(shapes['shapes']) + len(shapes['not_timed'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
