"""Helpers of ``benchmarks/gpu_check.py``: the models it trains, the matmul and attention
ops of a plan with the cost model's price of each, one op timed alone, and ``--prepare``
(the plan_quality shapes and the world-1 plans, computed ahead on a CPU with OR-Tools).

Import this only after ``gpu_check``'s path shim (``autopar.cost_models`` and
``autopar.passes`` mapped onto the top-level ``cost_models/`` and ``passes/``).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from autopar.cost_models import compute as compute_model
from autopar.cost_models import families
from autopar.cost_models.devices import Device
from autopar.cost_models.gpus import DEVICES
from autopar.sharding.registry import TensorMeta, input_placements, output_placements
from autopar.placement import placements_str

GPU_KEYS = ("a100", "h100", "h200")
"""The preset GPUs every prepared op is priced on (``cost_models.gpus.DEVICES``)."""
MAX_SHAPES = 40
"""At most this many plan_quality shapes are prepared (deduplicated)."""

# ---- the models --------------------------------------------------------------------------
# sizes: "gpu" for the GPU run, "dry" for --dry on a CPU. The GPT is examples/gpt.py's
# nanoGPT; the Llama is transformers' LlamaForCausalLM (SDPA attention, no KV cache); the
# Mixtral is transformers' MixtralForCausalLM (top-2 of 8 experts: one autopar::moe_experts op
# per layer, running the class's own experts forward on the GPU).
MODELS = {
    "gpu": {
        "gpt": dict(batch=8, n_embd=768, n_layer=4, n_head=12, block_size=512, vocab_size=8192),
        "llama": dict(batch=8, seq=512, vocab_size=8192, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4),
        "mixtral": dict(batch=8, seq=512, vocab_size=8192, hidden_size=512, intermediate_size=1024,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                        num_local_experts=8, num_experts_per_tok=2),
    },
    "dry": {
        "gpt": dict(batch=4, n_embd=64, n_layer=2, n_head=4, block_size=32, vocab_size=128),
        "llama": dict(batch=2, seq=32, vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        "mixtral": dict(batch=2, seq=32, vocab_size=256, hidden_size=64, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2),
    },
}


def hf_lm_loss(out, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a causal LM's ``out.logits`` (B, T, V) against ``target`` (B, T)."""
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def build_model(name: str, size: str, seed: int = 0):
    """(model on the CPU in fp32, loss_fn, batch, seq, vocab) of model ``name`` at ``size``."""
    cfg = dict(MODELS[size][name])
    batch = cfg.pop("batch")
    if name == "gpt":
        from examples.gpt import gpt_factory
        ex = gpt_factory(batch=batch, seed=seed, **cfg)
        return ex.model, ex.loss_fn, batch, cfg["block_size"], cfg["vocab_size"]
    if name in ("llama", "mixtral"):
        import transformers
        seq = cfg.pop("seq")
        config_cls, model_cls = ((transformers.LlamaConfig, transformers.LlamaForCausalLM) if name == "llama"
                                 else (transformers.MixtralConfig, transformers.MixtralForCausalLM))
        config = config_cls(max_position_embeddings=seq, use_cache=False, **cfg)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls._from_config(config, attn_implementation="sdpa")
        return model, hf_lm_loss, batch, seq, cfg["vocab_size"]
    raise KeyError(name)


def batches(n: int, batch: int, seq: int, vocab: int, seed: int = 1) -> list[tuple]:
    """``n`` random (tokens, target) batches, the same on every call."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


# ---- ops of a plan, priced -------------------------------------------------------------------
def _meta_json(m) -> list:
    return [list(m.shape), str(m.dtype).removeprefix("torch.")]


def _meta(j) -> TensorMeta:
    return TensorMeta(tuple(j[0]), getattr(torch, j[1]))


def call_flags(call) -> dict:
    """What besides shapes the cost model and the timing need of a matmul / attention call."""
    name = families.op_name(call.op)
    flags = {}
    if families.family(call.op) == families.ATTENTION:
        flags["is_causal"] = bool(compute_model._arg(call.op, call.args, call.kwargs or {}, "is_causal", False))
        mask = compute_model._arg(call.op, call.args, call.kwargs or {}, "attn_mask")
        if isinstance(mask, TensorMeta):
            flags["attn_mask"] = _meta_json(mask)
    if name == "linear":
        flags["bias"] = len(call.inputs) > 2
    return flags


def op_desc(call, ins, outs) -> dict:
    """A JSON description of one call at local shapes ``ins`` / ``outs``."""
    return {"op": str(call.op), "family": timing_family(call.op),
            "inputs": [_meta_json(m) for m in ins], "outputs": [_meta_json(m) for m in outs],
            "flags": call_flags(call)}


def timing_family(op) -> str:
    return "attention" if families.family(op) == families.ATTENTION else "matmul"


def shape_id(desc: dict) -> str:
    """A readable key of a description: op, input shapes and flags (what makes two calls one
    shape to time; every shape is timed in bf16, whatever dtype it was captured in)."""
    name = desc["op"].split(".")[1] if desc["op"].startswith("aten.") else desc["op"]
    dims = " ".join("x".join(map(str, s)) for s, _ in desc["inputs"])
    extra = "".join(f" {k}" for k, v in sorted(desc["flags"].items()) if v is True)
    if "attn_mask" in desc["flags"]:
        extra += " mask"
    return f"{name} {dims}{extra}"


def plan_ops(cap, plan, devices: dict[str, Device] | None = None, optimizer: str = "adamw") -> list[dict]:
    """Every matmul- and attention-family node of ``plan`` (not pipelined) with the local
    shapes of its chosen option, how many repeated-layer copies it stands for, and its
    (forward, backward) seconds: ``plan_s`` as the solver's price table has it (before
    recomputation), ``predicted`` by ``cost_models.compute.node_time`` on each of
    ``devices`` in the plan's precision (what ``pricing.costing.CostModel`` calls)."""
    from autopar.pricing.costing import _local
    from autopar.pricing.prices import plan_prices
    pt = plan_prices(cap, plan, optimizer)
    mesh = tuple(plan.mesh_shape)
    mixed = (plan.pins.get("precision") or "fp32") in ("bf16", "fp16")
    key = None if cap.native_dtypes and not mixed else (plan.pins.get("precision") or "fp32")
    out = []
    for name, v in pt.problem.vars.items():
        if v.call is None or families.family(v.call.op) not in (families.MATMUL, families.ATTENTION):
            continue
        chosen = plan.nodes.get(name)
        if chosen is None:
            continue
        for i, combo in enumerate(v.options):
            ins_p = tuple(placements_str(input_placements(combo, k)) for k in range(len(v.call.inputs)))
            outs_p = tuple(placements_str(output_placements(combo, k)) for k in range(len(v.outputs)))
            if ins_p != chosen.inputs or outs_p != chosen.outputs:
                continue
            ins = [_local(m, input_placements(combo, k), mesh) for k, m in enumerate(v.call.inputs)]
            outs = [_local(m, output_placements(combo, k), mesh) for k, m in enumerate(v.call.outputs)]
            d = op_desc(v.call, ins, outs)
            o = pt.option(name, i)
            d.update(node=name, members=len(v.members), plan_s=[o.forward_s, o.backward_s],
                     dtype_key=key, native=bool(cap.native_dtypes),
                     flops_fwd=compute_model.flops(v.call.op, ins, outs, v.call.args, v.call.kwargs))
            d["predicted"] = {k: list(compute_model.node_time(v.call.op, ins, outs, v.call.args, v.call.kwargs,
                                                              dev, key, native=cap.native_dtypes))
                              for k, dev in (devices or {}).items()}
            out.append(d)
            break
    return out


def resolve_op(name: str):
    """``torch.ops.aten.linear.default`` from ``"aten.linear.default"``."""
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def synth_predict(desc: dict, device: Device) -> tuple[float, float]:
    """(forward, backward) seconds of a described call by ``cost_models.compute.node_time``
    on ``device``, the call rebuilt from its description (shapes and flags)."""
    op = resolve_op(desc["op"])
    ins = [_meta(j) for j in desc["inputs"]]
    outs = [_meta(j) for j in desc["outputs"]]
    kwargs = {}
    if desc["flags"].get("bias"):
        kwargs["bias"] = ins[2]
    if "is_causal" in desc["flags"]:
        kwargs["is_causal"] = desc["flags"]["is_causal"]
    if "attn_mask" in desc["flags"]:
        kwargs["attn_mask"] = _meta(desc["flags"]["attn_mask"])
    return compute_model.node_time(op, ins, outs, (), kwargs, device, desc.get("dtype_key", "bf16"),
                                   native=desc.get("native", False))


def backward_flops(desc: dict) -> float:
    """The cost model's backward FLOPs convention (``compute._backward``): 2x a matmul's
    forward, 2.5x attention's."""
    return desc["flops_fwd"] * (2.5 if desc["family"] == "attention" else 2.0)


def scaled(desc: dict, cap: int = 64) -> dict:
    """``desc`` with every dimension above ``cap`` made ``cap`` (the same value maps to the
    same value, so the shapes still agree); a dry run times these on a CPU."""
    f = lambda s: [min(x, cap) for x in s]  # noqa: E731
    d = dict(desc, inputs=[[f(s), t] for s, t in desc["inputs"]],
             outputs=[[f(s), t] for s, t in desc["outputs"]], flags=dict(desc["flags"]))
    if "attn_mask" in d["flags"]:
        s, t = d["flags"]["attn_mask"]
        d["flags"]["attn_mask"] = [f(s), t]
    d["id"] = shape_id(d)
    d["flops_fwd"] = compute_model.flops(resolve_op(d["op"]), [_meta(j) for j in d["inputs"]],
                                         [_meta(j) for j in d["outputs"]], (),
                                         {"is_causal": d["flags"].get("is_causal", False)}
                                         if d["family"] == "attention" else
                                         ({"bias": _meta(d["inputs"][2])} if d["flags"].get("bias") else {}))
    return d


# ---- one op, timed -------------------------------------------------------------------------
def _runner(desc: dict, device: torch.device, dtype: torch.dtype):
    """(forward function, tensors needing grad) of a described call on ``device``: inputs
    random in ``dtype`` (the run's compute dtype, bf16), the call as torch runs it."""
    name = desc["op"].split(".")[1]
    ts = [torch.randn(s, device=device, dtype=dtype) * 0.1 for s, _ in desc["inputs"]]
    for t in ts:
        t.requires_grad_(True)
    fl = desc["flags"]
    if name == "linear":
        fwd = lambda: F.linear(ts[0], ts[1], ts[2] if fl.get("bias") else None)  # noqa: E731
    elif name in ("matmul", "mm", "bmm"):
        fn = {"matmul": torch.matmul, "mm": torch.mm, "bmm": torch.bmm}[name]
        fwd = lambda: fn(ts[0], ts[1])  # noqa: E731
    elif name in ("addmm", "baddbmm"):
        fn = torch.addmm if name == "addmm" else torch.baddbmm
        fwd = lambda: fn(ts[0], ts[1], ts[2])  # noqa: E731
    elif "scaled_dot_product" in name:
        mask = None
        if "attn_mask" in fl:
            s, t = fl["attn_mask"]
            mask = torch.ones(s, device=device, dtype=torch.bool).tril() if t == "bool" else \
                torch.zeros(s, device=device, dtype=dtype)
        gqa = ts[0].shape[-3] != ts[1].shape[-3]
        kw = {"enable_gqa": True} if gqa else {}
        fwd = lambda: F.scaled_dot_product_attention(  # noqa: E731
            ts[0], ts[1], ts[2], attn_mask=mask, is_causal=fl.get("is_causal", False) and mask is None, **kw)
    else:
        raise NotImplementedError(f"no runner for {desc['op']}")
    return fwd, ts


def op_bytes(desc: dict, itemsize: int = 2) -> int:
    """Bytes a timed call holds: inputs, outputs, and their gradients."""
    n = sum(math.prod(s) for s, _ in desc["inputs"]) + sum(math.prod(s) for s, _ in desc["outputs"])
    return 2 * n * itemsize


def time_op(desc: dict, device: torch.device, dtype: torch.dtype = torch.bfloat16, reps: int = 10,
            warmup: int = 3) -> dict:
    """Median forward and backward seconds of a described call over ``reps`` runs after
    ``warmup``: CUDA events on a GPU, ``perf_counter`` on a CPU. Backward is
    ``torch.autograd.grad`` of every input (retain_graph: one forward, many backwards)."""
    fwd, ts = _runner(desc, device, dtype)
    cuda = device.type == "cuda"

    def timed(fn) -> list[float]:
        for _ in range(warmup):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
        out = []
        for _ in range(reps):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return out

    with torch.no_grad():
        f = timed(fwd)
    y = fwd()
    g = torch.randn_like(y)
    b = timed(lambda: torch.autograd.grad(y, ts, g, retain_graph=True))
    del y, g, ts
    return {"fwd_s": statistics.median(f), "bwd_s": statistics.median(b),
            "fwd_all_s": f, "bwd_all_s": b}


# ---- --prepare -------------------------------------------------------------------------------
# The free plans of benchmarks/plan_quality.py as its docstring records them (published
# part: "Last run" 2026-11-23 06:20-07:35 for rows 4-11 and 13-16, the re-run of 16:59 for
# rows 0, 12, 14, 16): (row, tensor degree, data degree, micro-batches or accumulation per
# step, the free plan in words, the recorded gain over the published configuration). A
# rank's op shapes are set by its micro-batch (global batch / data / micro-batches) and
# the tensor degree; data parallelism, ZeRO, pipeline stages and recomputation do not
# change them. Re-plan a row (``plan_quality.py --rows N``) and update it here if it moves.
FREE_PLANS = [
    (0, 1, 32, 4, "d32 zero=2, accumulate 4", 1.31),
    (1, 1, 64, 4, "d64 zero=3, accumulate 4", 1.42),
    (2, 1, 128, 2, "d128 zero=3, accumulate 2", 1.69),
    (3, 1, 256, 2, "d256 zero=3, accumulate 2, recompute", 1.76),
    (4, 1, 512, 1, "d512 zero=3, recompute", 1.74),
    (5, 4, 32, 56, "p8 d32 t4, zero-bubble m=56", 1.55),
    (6, 8, 24, 96, "p8 d24 t8, zero-bubble m=96", 1.41),
    (7, 8, 6, 360, "p40 d6 t8, zero-bubble m=360", 1.41),
    (8, 8, 5, 504, "p63 d5 t8, zero-bubble m=504 zero=2", 1.27),
    (9, 8, 12, 256, "p32 d12 t8, 1f1b m=256 zero=2, recompute", 1.20),
    (10, 8, 5, 384, "p56 d5 t8, zero-bubble m=384 zero=2", 1.43),
    (11, 8, 4, 256, "p12 d4 t8, 1f1b m=256 zero=2", 1.23),
    (12, 1, 64, 1, "d64 zero=3 (the published plan)", 1.00),
    (13, 1, 64, 1, "d64 zero=3, recompute", 1.04),
    (14, 1, 8, 2, "d8 zero=2, accumulate 2", 1.01),
    (15, 8, 64, 32, "t8 p16 d64 (the published mesh), interleaved 1F1B v=4", 1.00),
    (16, 8, 128, 16, "t8 p16 d128 (the published mesh), interleaved 1F1B v=8", 1.00),
]
SHAPE_LAYERS = 2
"""Layers each row's model is captured with for its shapes (every layer has the same ones)."""


def row_ops(row: int, tensor: int, micro: int, log=print) -> tuple[list[dict], dict]:
    """The matmul and attention ops of plan_quality row ``row`` at a rank's micro-batch
    ``micro`` and tensor degree ``tensor``: its model (``published_runs.build``) with
    ``SHAPE_LAYERS`` layers, captured and planned on one node of ``tensor`` of its GPUs
    with ``tensor=`` and ``precision="bf16"`` pinned (the free search pins only the
    precision), priced on every ``GPU_KEYS`` device."""
    from published_runs import RUNS, build

    from autopar.capture import capture
    from autopar.cost_models.hardware import parse_cluster
    from autopar.solver.flat import plan_captured
    run = RUNS[row]
    ex = build(replace(run, layers=SHAPE_LAYERS), micro)
    cap = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    cl = parse_cluster(f"1x{tensor}x{run.device}")
    plan = plan_captured(cap, cl, tensor, pins={"tensor": tensor, "precision": "bf16"})
    ops = plan_ops(cap, plan, {k: DEVICES[k] for k in GPU_KEYS})
    info = {"run": run.name, "gpus": run.gpus, "device": run.device, "arch": run.arch,
            "layers": run.layers, "hidden": run.hidden, "heads": run.heads, "seq": run.seq,
            "vocab": run.vocab, "global_batch": run.batch, "mesh": list(plan.mesh_shape)}
    return ops, info


def _attention_like(desc: dict) -> bool:
    """Attention's own ops: SDPA, or a batched matmul (unfused attention's scores and
    context products); a linear or 2-D mm is a GEMM of the weights."""
    return desc["family"] == "attention" or desc["op"].split(".")[1] in ("matmul", "bmm", "baddbmm")


def prepare_shapes(log=print) -> dict:
    """Every row of ``FREE_PLANS``: its ops, deduplicated by shape, and the shapes to time
    (at most ``MAX_SHAPES``): rows in order of recorded gain (the free search exploits the
    shapes where the model is most optimistic: those first), each row's ops by their share
    of its predicted matmul + attention time, taken round-robin over the rows."""
    from published_runs import RUNS
    shapes: dict[str, dict] = {}
    rows = []
    for row, t, d, m, text, gain in FREE_PLANS:
        t0 = time.perf_counter()
        batch = RUNS[row].batch
        if batch % (d * m):
            raise ValueError(f"row {row}: batch {batch} is not divisible by data {d} x {m}")
        micro = batch // (d * m)
        ops, info = row_ops(row, t, micro, log)
        total = 0.0
        entries = []
        for o in ops:
            sid = shape_id(o)
            dev = o["predicted"][info["device"]]
            per_layer = o["members"] == SHAPE_LAYERS      # one copy per layer: the full model has run.layers
            share = (dev[0] + dev[1]) * (info["layers"] if per_layer else o["members"])
            total += share
            if sid not in shapes:
                shapes[sid] = {k: o[k] for k in ("op", "family", "inputs", "outputs", "flags", "dtype_key",
                                                  "native", "flops_fwd", "predicted")}
                shapes[sid]["id"] = sid
                shapes[sid]["rows"] = []
            shapes[sid]["rows"].append({"row": row, "node": o["node"], "per_layer": per_layer})
            entries.append((sid, share))
        merged: dict[str, float] = {}
        for sid, s in entries:
            merged[sid] = merged.get(sid, 0.0) + s
        order = sorted(merged, key=merged.get, reverse=True)
        # each row's largest GEMM first, then its largest attention op (SDPA, or the
        # batched matmuls of unfused attention), then the rest by share
        firsts = [next((i for i in order if _attention_like(shapes[i]) == a), None) for a in (False, True)]
        firsts = [i for i in firsts if i is not None]
        order = firsts + [i for i in order if i not in firsts]
        rows.append(dict(row=row, free_plan=text, gain_recorded=gain, tensor=t, data=d,
                         micro_batches=m, micro_batch=micro, **info,
                         ops=[{"id": sid, "share": merged[sid] / total,
                               "attention": _attention_like(shapes[sid])} for sid in order]))
        log(f"  row {row:>2} {info['run']:<12} t{t} micro {micro}: {len(ops)} ops, "
            f"{len(order)} shapes ({time.perf_counter() - t0:.1f} s)", flush=True)
    chosen: list[str] = []
    queue = sorted(rows, key=lambda r: (-r["gain_recorded"], r["row"]))
    depth = 0
    while len(chosen) < MAX_SHAPES and any(depth < len(r["ops"]) for r in queue):
        for r in queue:
            if depth < len(r["ops"]) and len(chosen) < MAX_SHAPES:
                sid = r["ops"][depth]["id"]
                if sid not in chosen:
                    chosen.append(sid)
        depth += 1
    for r in rows:
        r["coverage"] = sum(o["share"] for o in r["ops"] if o["id"] in chosen)
    return {"rows": rows, "shapes": [shapes[s] for s in chosen],
            "not_timed": sorted(set(shapes) - set(chosen))}


def prepare_plans(sizes=("gpu", "dry"), log=print) -> dict:
    """World-1 plans of the two models (``precision="bf16"``, SGD with momentum), for
    clusters ``1x1x<GPU>`` at the GPU sizes and ``cpu:1`` at the dry sizes: the GPU run
    loads them where OR-Tools is missing."""
    import autopar
    out: dict = {}
    for size in sizes:
        keys = ("h100", "h200") if size == "gpu" else ("cpu",)
        for name in ("gpt", "llama"):
            model, loss_fn, batch, seq, vocab = build_model(name, size)
            x, y = batches(1, batch, seq, vocab)[0]
            for k in keys:
                t0 = time.perf_counter()
                cluster = "cpu:1" if k == "cpu" else f"1x1x{k.upper()}"
                p = autopar.plan(model, (x,), loss_fn, target=y, cluster=cluster, world_size=1,
                                 optimizer="sgd_momentum", precision="bf16")
                out.setdefault(size, {}).setdefault(k, {})[name] = p.to_dict()
                log(f"  plan {size} {name} on {cluster}: {p.estimate.step_time_s * 1e3:.2f} ms, "
                    f"{p.estimate.memory_total / 2**20:.0f} MiB ({time.perf_counter() - t0:.1f} s)", flush=True)
    return out
