"""The sweep's ``fp8`` cases (``precision="fp8"``) judged against one device running the SAME
fp8 recipe, as ``tests/fp8_worker.py`` judges its small GPT.

The reference (:func:`fp8_reference`): a copy of the model whose fp8 linears (the plan's,
``analysis.fp8_layers.planned_fp8_linears``) call ``ops.fp8.fp8_linear`` with no shards
(``use_fp8_linears``) and whose fp8 experts modules (``planned_fp8_experts``) run their
GEMMs so (``ops.fp8_experts.use_fp8_experts``), under ``torch.autocast(bfloat16)``,
stepping through the batch in the row blocks a step of the plan scales apart
(``analysis.fp8_layers.row_blocks``: its data-parallel degree times its micro-batches),
each block its own backward and its loss term of the global loss. (An experts op whose
tokens come from several data-parallel ranks, the all-gather or all-to-all dispatch over a
data axis, scales their rows together: there the reference differs by fp8 roundings,
``tests/test_fp8_experts.py``.) Beside it the plain bf16 autocast run on the whole batch (no fp8),
to tell fp8 arithmetic from bf16's.

Tolerances, from the formats (``tests/test_fp8.py``'s module docstring derives and measures
them on the GPT): e4m3 keeps 3 mantissa bits (neighbours q = 2^-3 apart), e5m2 2 bits
(q = 2^-2), bf16's unit roundoff u = 2^-8.

``tests/test_fp8.py`` holds data-parallel and ZeRO-3 plans of the example GPT to 1e-6 of the
recipe: there every bf16 op of the plan equals one device's bit for bit, so both compute the
same fp8 values (so do GPT-NeoX, Mistral, Phi, Qwen2, Swin and ViT here). Other zoo models'
bf16 plans are not bit-equal to eager autocast, even on one rank (bart under
``precision="bf16"``, one device, no pins: the first step's gradients of 63 of 91
parameters differ; the sweep's ``bf16`` kind allows 0.1). A GEMM input moved by a bf16
rounding crosses an fp8 rounding boundary with probability u / q and then moves by q: an
RMS change of sqrt(u q) per element, the bound test_fp8 holds tensor parallelism's bf16
partial sums to. Through a chain of fp8 GEMMs such flips compound, so the model's own
sensitivity is measured too: the recipe against its twin with every other op in fp32
(``noise_``), allowed NOISE_FACTOR times, as the sweep allows bf16 and fp16 their
one-device noise (``sweep_cases.compare_sgd``). :func:`allowed`:

- the first step's gradient (every parameter together): max(TP_GRAD_TOL = sqrt(u q_e5m2)
  = 2^-5, NOISE_FACTOR x the twin's);
- the loss of every step (SGD and AdamW): max(TP_LOSS_TOL = u, NOISE_FACTOR x the twin's);
- the weights after the steps (every parameter together, relative to how far they moved;
  SGD and AdamW, AdamW's on the elements ``sweep_cases.compare_adamw`` keeps:
  :func:`adam_keep`): NOISE_FACTOR x the twin's;
- and gradient and weights nearer the recipe than the plain bf16 run is, wherever the bf16
  run is farther from the recipe than the twin (else that comparison cannot tell fp8 from
  bf16). A gradient 5% off fails (``tests/test_sweep.py``).
"""
from __future__ import annotations

import copy
import math

import torch

from autopar.analysis.fp8_layers import planned_fp8_experts, planned_fp8_linears, row_blocks
from autopar.ops.fp8 import fp8_linear, use_fp8_linears
from autopar.ops.fp8_experts import use_fp8_experts

Q_E4M3, Q_E5M2, U_BF16 = 2.0 ** -3, 2.0 ** -2, 2.0 ** -8
TP_GRAD_TOL, TP_LOSS_TOL = math.sqrt(U_BF16 * Q_E5M2), U_BF16
NOISE_FACTOR = 4.0
"""``sweep_cases.NOISE_FACTOR``: the allowance for one device's own rounding, as for bf16 and
fp16 (qwen3 on one rank, no pins, rowwise: the plan 3.4e-2 from the recipe, the recipe
3.3e-2 from itself with the other ops in fp32)."""


def _blocks_loss(b, model, slices: int, autocast: bool = True):
    """One step's forward and backward on ``slices`` equal row blocks under autocast bf16,
    each block's backward its own (its term of the global loss; a model's own loss: the
    mean of the blocks'); the step's loss."""
    xs = [x.tensor_split(slices) for x in b.inputs]
    total = 0.0
    for k in range(slices):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(*(x[k] for x in xs))
            if b.loss_fn is None:
                loss = out / slices
            else:
                loss = b.spec.term(out, b.target.tensor_split(slices)[k]) / b.spec.denominator(b.target)
        loss.backward()
        total = total + loss.detach()
    return total


def _fp8_in_fp32(model, weights: set, scaling: str) -> None:
    """``use_fp8_linears`` for a model run without autocast: each fp8 linear's bf16 output
    back to fp32, so that the ops between them run in fp32."""
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and f"{name}.weight" in weights:
            mod.forward = (lambda x, mod=mod: fp8_linear(x, mod.weight, mod.bias, scaling).float())


def fp8_reference(b, weights: set | None, scaling: str | None, slices: int, opt_kind: str,
                  hyper: dict, rest_fp32: bool = False):
    """``hyper["steps"]`` steps of ``opt_kind`` on one device: the model's linears whose
    weight is in ``weights`` (and its experts modules named there) under fp8 recipe
    ``scaling`` (None: plain bf16 autocast), on ``slices`` row blocks a step;
    ``rest_fp32``: every other op in fp32 (no autocast). ``hyper``: lr, momentum, adam_lr,
    steps. Returns (losses, gradients by step for SGD, weights after, initial weights)."""
    model = copy.deepcopy(b.model)          # before the patch: a patched forward is not copied
    if scaling is not None and weights:
        mods = dict(model.named_modules())
        experts = {w for w in weights if not w.endswith(".weight") and w in mods}
        linears = set(weights) - experts
        (_fp8_in_fp32 if rest_fp32 else use_fp8_linears)(model, linears, scaling)
        use_fp8_experts(model, experts, scaling, out_fp32=rest_fp32)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = (torch.optim.SGD(model.parameters(), lr=hyper["lr"], momentum=hyper["momentum"])
           if opt_kind == "sgd" else torch.optim.AdamW(model.parameters(), lr=hyper["adam_lr"]))
    losses, grads = [], []
    for _ in range(hyper["steps"]):
        opt.zero_grad()
        losses.append(float(_blocks_loss(b, model, slices, autocast=not rest_fp32)))
        if opt_kind == "sgd":
            grads.append({n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                          if p.grad is not None})
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}, initial


def references(b, cap, plan, hyper: dict) -> dict:
    """The plan's fp8 weights and experts modules, its row blocks, and the (SGD, AdamW) runs of the same recipe
    (``fp8``) and of plain bf16 on the whole batch (``bf16``)."""
    weights = (set(planned_fp8_linears(cap, plan.options).values())
               | set(planned_fp8_experts(cap, plan.options).values()))
    scaling, slices = plan.options.fp8_scaling, row_blocks(plan)
    return {"weights": weights, "slices": slices,
            "experts": len(set(planned_fp8_experts(cap, plan.options).values())),
            "fp8": [fp8_reference(b, weights, scaling, slices, o, hyper) for o in ("sgd", "adamw")],
            "bf16": [fp8_reference(b, None, None, 1, o, hyper) for o in ("sgd", "adamw")],
            "noise": [fp8_reference(b, weights, scaling, slices, o, hyper, rest_fp32=True)
                      for o in ("sgd", "adamw")]}


def _rel(a: dict, ref: dict, base: dict | None = None, keep: dict | None = None) -> float:
    """||a - ref|| / ||ref - base|| over every entry of ``ref`` together (base None: ||ref||);
    ``keep``: only the elements each mask keeps."""
    def part(t, k):
        return t[keep[k]] if keep is not None and k in keep else t
    num = sum(float(((part(a[k], k).double() - part(ref[k], k).double()) ** 2).sum()) for k in ref)
    den = sum(float(((part(ref[k], k).double() - (0 if base is None else part(base[k], k).double()))
                     ** 2).sum()) for k in ref)
    return math.sqrt(num / max(den, 1e-300))


def adam_keep(first_grads: dict, noise: float) -> dict:
    """The elements AdamW's weights are compared on, as ``sweep_cases.compare_adamw`` does:
    those whose first one-device gradient is above ``noise`` x its parameter's RMS (the whole
    gradient's where the parameter's is below 1e-5 of it). A gradient zero in exact
    arithmetic (an expert the skewed router sends no token, a key's bias) holds rounding
    noise on either side, which AdamW divides by its own size and so moves by ~lr either way
    (mixtral-skewed:fp8:336481: 1.8e-1 over every element, as far as the bf16 run)."""
    total_sq = sum(float(g.double().norm()) ** 2 for g in first_grads.values())
    total_rms = math.sqrt(total_sq / max(sum(g.numel() for g in first_grads.values()), 1))
    keep = {}
    for name, g in first_grads.items():
        norm = float(g.double().norm())
        rms = total_rms if norm <= 1e-5 * math.sqrt(total_sq) else norm / math.sqrt(max(g.numel(), 1))
        keep[name] = g.abs() > noise * rms
    return keep


def _loss_err(a: list, ref: list) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, ref))


def _distances(sgd: tuple, adam: tuple, ref: list, tag: str, keep: dict) -> dict:
    """(losses, gradients by step, weights) of an SGD and an AdamW run against ``ref``'s
    (AdamW's weights on the elements of ``keep``: :func:`adam_keep`)."""
    (ls, gs, ws, w0), (la, _, wa, wa0) = ref
    return {tag + "loss": max(_loss_err(sgd[0], ls), _loss_err(adam[0], la)),
            tag + "grad": _rel(sgd[1][0], gs[0]), tag + "weight": _rel(sgd[2], ws, w0),
            tag + "adam_weight": _rel(adam[2], wa, wa0, keep)}


def measure(run_sgd, run_adam, refs: dict, noise: float) -> dict:
    """One rank's runs (``sweep_cases.Run``: losses, gradients by step, weights) against the
    fp8 reference; and the reference's distance from the plain bf16 run (``bf16_``) and from
    the same recipe with every other op in fp32 (``noise_``): loss (every step, both
    optimizers), the first step's gradient, the weights after (SGD and AdamW, its elements
    those of :func:`adam_keep` with ``noise``), each relative; and what is missing."""
    out: dict = {"problems": []}
    ls, gs, ws, _ = refs["fp8"][0]
    missing = sorted(set(gs[0]) - set(run_sgd.grads[0])) + sorted(set(ws) - set(run_sgd.weights))
    if missing:
        out["problems"].append(f"no gradient or weight for {missing[0]}")
        return out
    sgd, adam = (run_sgd.losses, run_sgd.grads, run_sgd.weights), (run_adam.losses, None, run_adam.weights)
    keep = adam_keep(gs[0], noise)
    out.update(_distances(sgd, adam, refs["fp8"], "", keep))
    for tag in ("bf16", "noise"):       # one device's other runs against the recipe
        other_sgd, other_adam = refs[tag]
        out.update(_distances(other_sgd[:3], other_adam[:3], refs["fp8"], tag + "_", keep))
    if not all(math.isfinite(x) for x in run_sgd.losses + run_adam.losses):
        out["problems"].append(f"non-finite loss {run_sgd.losses} / {run_adam.losses}")
    return out


def allowed(m: dict) -> dict:
    """What each measure may reach (module docstring): the format's bound or, larger,
    NOISE_FACTOR x the fp8 recipe's own distance from its twin with the other ops in fp32
    (``noise_``); for the gradient and the weights, below the plain bf16 run's distance from
    the recipe (nearer the recipe than bf16 is) where that distance is the larger of the two
    (where the bf16 run is nearer the recipe than its fp32 twin is, the comparison tells fp8
    from bf16 nothing: ConvNeXt's 4 small fp8 linears under tensor=4, 2.1e-3 and 4.5e-3)."""
    out = {"loss": max(TP_LOSS_TOL, NOISE_FACTOR * m["noise_loss"])}
    for k, bound in (("grad", TP_GRAD_TOL), ("weight", 0.0), ("adam_weight", 0.0)):
        own = max(bound, NOISE_FACTOR * m["noise_" + k])
        out[k] = min(own, m["bf16_" + k]) if m["bf16_" + k] > m["noise_" + k] else own
    return out


def verdict(m: dict, twin: dict | None = None) -> tuple[str, str]:
    """(status, first line) of :func:`measure`'s numbers against :func:`allowed`; with
    ``twin`` (the same plan in bf16 against one device in bf16: its 16-bit arithmetic that
    the recipe does not do, ``sweep_cases.bf16_twin_distances``) each allowance plus the
    twin's distance."""
    if m["problems"]:
        return "fail", f"fp8: {m['problems'][0]}"
    tol = allowed(m)
    if twin:
        tol = {k: v + twin.get(k, 0.0) for k, v in tol.items()}
    bad = [f"{k} err {m[k]:.2e} > {tol[k]:.1e}" + (" (the bf16 run's distance)"
                                                   if tol[k] == m.get("bf16_" + k) else "")
           for k in tol if not m[k] < tol[k]]
    if bad:
        return "fail", "fp8: " + "; ".join(bad) + (" (with the plan's bf16 twin)" if twin else "")
    return "pass", (f"within the recipe's allowances plus the plan's bf16 twin's distance from one "
                    f"device in bf16 (grad {twin.get('grad', 0.0):.1e})" if twin else "")


def distances_of(run_sgd, run_adam, ref: list, keep: dict) -> dict:
    """(loss, grad, weight, adam_weight) of one rank's runs (``sweep_cases.Run``) against
    ``ref``'s runs (:func:`_distances`)."""
    sgd = (run_sgd.losses, run_sgd.grads, run_sgd.weights)
    adam = (run_adam.losses, None, run_adam.weights)
    return _distances(sgd, adam, ref, "", keep)


def detail(m: dict, refs: dict, scaling: str) -> str:
    experts = refs.get("experts", 0)
    named = (f"{len(refs['weights']) - experts} fp8 linears"
             + (f" and {experts} experts modules" if experts else ""))
    return (f"fp8 {scaling}, {named}, {refs['slices']} row blocks: loss "
            f"{m.get('loss', math.nan):.1e} grad {m.get('grad', math.nan):.1e} weight "
            f"{m.get('weight', math.nan):.1e} AdamW weight {m.get('adam_weight', math.nan):.1e}; "
            f"the bf16 run from the recipe: grad {m.get('bf16_grad', math.nan):.1e} weight "
            f"{m.get('bf16_weight', math.nan):.1e}; the recipe with the rest in fp32: grad "
            f"{m.get('noise_grad', math.nan):.1e} loss {m.get('noise_loss', math.nan):.1e}")
