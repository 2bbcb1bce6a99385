"""A mixture of experts' expert computation as one op, and the expert-parallel forms of it.

Hugging Face's MoE layers (Mixtral, Qwen3-MoE, DeepSeek-V3, OLMoE, GPT-OSS, ...) keep their
experts in one module whose weights are stacks with the experts on dim 0 (``gate_up_proj``
``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``, biases ``[E, ...]``) and whose forward is
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``:

    out[t] = sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden[t])

Capture (``autopar.capture.experts``) records that call as the one op
``autopar::moe_experts(hidden, top_k_index, top_k_weights, stacks, key)``, so no shape in the
graph depends on how the example batch was routed, and the sharding rules
(``autopar.sharding.rules.experts``) see what the computation is: a sum over experts. Its
forms on one mesh axis:

- replicated, or tokens split (data parallel): the model's own forward (the op itself);
- experts split, tokens whole (the all-gather dispatch): each rank computes its own experts'
  terms for every token; the output is partial (P), summed by the all-reduce or
  reduce-scatter the rewrite inserts after it;
- experts and tokens split on the same axis (the all-to-all dispatch): each token-expert
  pair travels to the rank holding its expert (``all_to_all_single`` with sizes known only
  at run time), is computed there and comes back; dropless, so every token reaches its
  experts as on one device.

:func:`run_experts` is the local call of the split forms. It runs the model's own experts
module (a copy whose ``num_experts`` is the local count) on the pairs that are this rank's,
with routing weight 1, and applies the routing weights where the pairs came from, so the
gradient of every stack, of the hidden state and of the router reaches the same values as
on one device.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import threading
import types
from dataclasses import dataclass

import torch
from torch import nn

from autopar.device import CUDA
from autopar.ops.collectives import all_to_all_v
from autopar.ops.comm import current_comm
from autopar.ops.fp8_experts import fp8_experts_forward, parse_key

OP_NAME = "autopar::moe_experts"
SPLIT_OP_NAME = "autopar::moe_experts_split"
BACKWARD_OP_NAME = "autopar::moe_experts_backward"


@dataclass(frozen=True)
class ExpertsTemplate:
    """The structure of one kind of experts module (its weights on the meta device)."""
    module: nn.Module
    names: tuple[str, ...]          # the stacks, in the op's order
    num_experts: int
    forward: types.FunctionType     # the class's own forward (not capture's stand-in)


_TEMPLATES: dict[str, ExpertsTemplate] = {}
_LOCK = threading.Lock()
_PER_THREAD = threading.local()     # functional_call swaps a module's weights in place:
                                    # ranks simulated as threads each call their own copy


def is_experts_module(m: nn.Module) -> bool:
    """A Hugging Face experts module (``@use_experts_implementation``): weights stacked on
    dim 0 by expert, ``forward(hidden, top_k_index, top_k_weights)``."""
    # has_gate and is_concatenated: set by the decorator (transformers 5.17 and 5.24 alike)
    if not all(hasattr(m, a) for a in ("num_experts", "has_gate", "is_concatenated")):
        return False
    params = list(m.parameters())
    e = getattr(m, "num_experts")
    return (isinstance(e, int) and e > 1 and bool(params)
            and all(p.ndim >= 2 and p.shape[0] == e for p in params)
            and not list(m.buffers()))


def template_key(m: nn.Module, forward: types.FunctionType) -> str:
    """The key of ``m``'s template, registering it on first sight: modules of one class with
    equal configurations and weight shapes share one (stamped layers carry the same key)."""
    names = tuple(n for n, _ in m.named_parameters())
    shapes = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in m.named_parameters())
    cfg = getattr(m, "config", None)
    try:
        cfg_text = cfg.to_json_string(use_diff=False) if cfg is not None else ""
    except Exception:  # noqa: BLE001 - a config that does not serialize: one per object
        cfg_text = f"config@{id(cfg)}"
    extra = json.dumps({k: repr(v) for k, v in sorted(vars(m).items())
                        if not k.startswith("_") and k != "config"
                        and isinstance(v, (int, float, bool, str))}, sort_keys=True)
    sig = repr((type(m).__module__, type(m).__qualname__, shapes, cfg_text, extra))
    key = f"{type(m).__name__}-{hashlib.sha1(sig.encode()).hexdigest()[:12]}"
    with _LOCK:
        if key not in _TEMPLATES:
            memo = {id(p): nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                        requires_grad=p.requires_grad) for p in m.parameters()}
            module = copy.deepcopy(m, memo)
            module.__dict__.pop("forward", None)
            _TEMPLATES[key] = ExpertsTemplate(module, names, m.num_experts, forward)
    return key


def template(key: str) -> ExpertsTemplate:
    """The template of ``key`` (an fp8 op's key too: ``ops.fp8_experts.fp8_key``)."""
    try:
        return _TEMPLATES[parse_key(key)[0]]
    except KeyError:
        raise RuntimeError(f"no experts module {key!r} was captured in this process: the "
                           "per-rank program must come from autopar.capture here") from None


def _module(key: str, n_local: int) -> nn.Module:
    """The experts module of ``key`` holding ``n_local`` experts, running its own forward."""
    cache = getattr(_PER_THREAD, "modules", None)
    if cache is None:
        cache = _PER_THREAD.modules = {}
    m = cache.get((key, n_local))
    if m is None:
        t = template(key)
        with _LOCK:
            m = copy.deepcopy(t.module)
        m.num_experts = n_local
        m.forward = types.MethodType(t.forward, m)
        cache[(key, n_local)] = m
    return m


def _call(key: str, n_local: int, stacks, hidden, index, weights) -> torch.Tensor:
    base, fp8 = parse_key(key)
    m = _module(base, n_local)
    if fp8 is not None:         # its GEMMs in fp8 (ops.fp8_experts)
        return fp8_experts_forward(m, list(stacks), hidden, index, weights, *fp8)
    params = dict(zip(_TEMPLATES[base].names, stacks))
    return torch.func.functional_call(m, params, (hidden, index, weights))


# ---- the op --------------------------------------------------------------------------------

@torch.library.custom_op(OP_NAME, mutates_args=())
def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                stacks: list[torch.Tensor], key: str) -> torch.Tensor:
    """The experts module of ``key`` with weights ``stacks`` (all its experts)."""
    with torch.no_grad():
        return _call(key, template(key).num_experts, stacks, hidden, top_k_index,
                     top_k_weights).clone()


@moe_experts.register_fake
def _(hidden, top_k_index, top_k_weights, stacks, key):
    return torch.empty_like(hidden)


def _setup(ctx, inputs, output):
    hidden, index, weights, stacks, key = inputs
    ctx.key, ctx.n = key, len(stacks)
    ctx.save_for_backward(hidden, index, weights, *stacks)


def _recomputed_grads(fn, grad, hidden, index, weights, stacks, *, in_kernel: bool):
    """Gradients of ``fn(hidden, index, weights, stacks)`` against ``grad`` for the hidden
    state, the routing weights and each stack (zeros where unused), by running ``fn`` again.
    In an autograd formula (``in_kernel=False``), with ``torch.autograd.grad``. In a custom
    op's kernel, which runs below autograd where ``autograd.grad`` would find no graph,
    under ``torch.func.vjp`` (a functorch transform differentiates there; it refuses to
    run under saved-tensor hooks, which only the eager runtime sets)."""
    if in_kernel:
        _, vjp = torch.func.vjp(lambda h, w, s: fn(h, index, w, s), hidden, weights, list(stacks))
        gh, gw, gs = vjp(grad)
        return gh, gw, list(gs)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in (hidden, weights, *stacks)]
        h, w, *s = leaves
        out = fn(h, index, w, s)
        want = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad(out, want, grad, allow_unused=True))
        grads = [next(got) if t.requires_grad else None for t in leaves]
    gh, gw, *gs = [g if g is not None else torch.zeros_like(t) if t.requires_grad else None
                   for g, t in zip(grads, leaves)]
    return gh, gw, gs


def _experts_fn(key: str, axes, dispatch):
    """The computation to differentiate: the whole op (no ``axes``) or a split form."""
    if axes:
        return lambda h, i, w, s: _run_experts(h, i, w, s, key, tuple(axes), tuple(dispatch))
    n = template(key).num_experts
    return lambda h, i, w, s: _call(key, n, s, h, i, w)


@torch.library.custom_op(BACKWARD_OP_NAME, mutates_args=())
def moe_experts_backward(grad: torch.Tensor, hidden: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor, stacks: list[torch.Tensor], key: str,
                         axes: list[int], dispatch: list[int]) -> list[torch.Tensor]:
    """The gradients of the hidden state, the routing weights and each stack of
    ``moe_experts`` (no ``axes``) or of ``moe_experts_split``: the forward run again with
    autograd on (its all-to-alls too). One op, so that a compiled program's backward graph
    holds it whole: what it runs has shapes known only at run time."""
    gh, gw, gs = _recomputed_grads(_experts_fn(key, axes, dispatch), grad, hidden, top_k_index,
                                   top_k_weights, stacks, in_kernel=True)
    return [gh, gw, *gs]


@moe_experts_backward.register_fake
def _(grad, hidden, top_k_index, top_k_weights, stacks, key, axes, dispatch):
    return [torch.empty_like(hidden), torch.empty_like(top_k_weights), *map(torch.empty_like, stacks)]


BACKWARD_OP = torch.ops.autopar.moe_experts_backward.default


def _experts_grads(ctx, grad, axes: tuple, dispatch: tuple):
    """The backward of either op: eagerly, the forward again under autograd; while
    ``torch.compile`` traces the backward, the opaque ``moe_experts_backward`` op (what it
    runs has shapes known only at run time)."""
    hidden, index, weights, *stacks = ctx.saved_tensors
    # traced: AOTAutograd hands the formula its tracer's tensors (torch 2.11 does not say
    # is_compiling() there); eagerly, a plain tensor
    if torch.compiler.is_compiling() or type(grad) is not torch.Tensor:
        gh, gw, *gs = BACKWARD_OP(grad, hidden, index, weights, stacks, ctx.key, list(axes), list(dispatch))
        return gh, gw, gs
    return _recomputed_grads(_experts_fn(ctx.key, axes, dispatch), grad, hidden, index, weights, stacks,
                             in_kernel=False)


def _backward(ctx, grad):
    gh, gw, gs = _experts_grads(ctx, grad, (), ())
    return gh, None, gw, gs, None


moe_experts.register_autograd(_backward, setup_context=_setup)

EXPERTS_OP = torch.ops.autopar.moe_experts.default


def run_whole(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
              stacks: list[torch.Tensor], key: str) -> torch.Tensor:
    """The experts op on this rank's stacks where no split form applies (all experts here:
    replicated, tokens split, or each expert split). Eagerly, the module's own forward under
    autograd, which keeps what its backward reads (as the cost model prices it:
    ``pricing/experts.py``) instead of computing the forward again in backward, as the op
    does. Under ``torch.compile``, the op: its forward has shapes known only at run time."""
    if torch.compiler.is_compiling():
        return EXPERTS_OP(hidden, top_k_index, top_k_weights, list(stacks), key)
    h, s = sixteen_bit(hidden, stacks, key)
    return _call(key, template(key).num_experts, s, h, top_k_index, top_k_weights).to(hidden.dtype)


SIXTEEN_BIT_DEVICES = {CUDA}
"""Device types whose experts run on 16-bit operands under autocast (:func:`sixteen_bit`)."""


def sixteen_bit(hidden: torch.Tensor, stacks, key: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``hidden`` and the floating ``stacks`` in autocast's dtype where autocast is on for
    their device (mixed precision, ``runtime.precision``), as autocast gives a matrix
    product its operands; else as they are. transformers' grouped experts
    (``torch._grouped_mm``) are not autocast-enabled and cast the tokens to the weights'
    dtype, so with fp32 master weights they ran in fp32: on an H200 (the GPU check's scale
    section, 2026-11-30) DeepSeek-V3's two MoE layers under ``expert=8`` took 379 ms of
    ``_grouped_mm`` a step, priced in bf16 at 46 ms for every matrix product of the step.
    The 16-bit stacks are the weight copies the ``params`` term counts. Eager programs only:
    a compiled program's opaque experts ops keep their operands' dtypes, and fp8 experts
    (``key`` with its recipe, ``ops.fp8_experts``) cast for their GEMMs themselves. On the
    devices of :data:`SIXTEEN_BIT_DEVICES` only: on CPU ranks torch's ``MemTracker`` (the
    CPU's peak measure, ``runtime.timing``) refuses a module run on weights that are not
    leaves, and fp32 there costs little."""
    dev = hidden.device.type
    if dev not in SIXTEEN_BIT_DEVICES or not torch.is_autocast_enabled(dev) \
            or parse_key(key)[1] is not None:
        return hidden, list(stacks)
    dt = torch.get_autocast_dtype(dev)
    return hidden.to(dt), [t.to(dt) if t.is_floating_point() else t for t in stacks]


# ---- the split forms ---------------------------------------------------------------------

def run_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                stacks: list[torch.Tensor], key: str, axes: tuple[int, ...],
                dispatch: tuple[int, ...] = ()) -> torch.Tensor:
    """This rank's part of the experts op: ``axes`` (mesh order, earlier axis outer) split
    the stacks on dim 0; on the ``dispatch`` axes among them the tokens are split too (the
    all-to-all form: the whole output for this rank's tokens), on the others the tokens are
    whole (the all-gather form: this rank's experts' terms, P).

    Under ``torch.compile`` (``compile=True``) the call is the opaque op
    ``autopar::moe_experts_split``: which pairs a rank keeps and how many it sends are known
    only at run time, which a graph of static shapes cannot hold."""
    if torch.compiler.is_compiling():
        return SPLIT_OP(hidden, top_k_index, top_k_weights, list(stacks), key, list(axes), list(dispatch))
    return _run_experts(hidden, top_k_index, top_k_weights, stacks, key, tuple(axes), tuple(dispatch))


def _run_experts(hidden, top_k_index, top_k_weights, stacks, key, axes, dispatch):
    comm = current_comm()
    axes = tuple(axes)
    t = template(key)
    n_local = stacks[0].shape[0]
    sizes = [comm.size(a) for a in axes]
    if math.prod(sizes) * n_local != t.num_experts:
        raise RuntimeError(f"experts op {key}: {n_local} local experts on axes {axes} "
                           f"(sizes {sizes}) do not make {t.num_experts}")
    n_tok, k = top_k_index.shape
    tok = torch.arange(n_tok, device=hidden.device).repeat_interleave(k)
    expert = top_k_index.reshape(-1)
    route = top_k_weights.reshape(-1)
    # each pair's expert block, as a coordinate on each split axis: the all-gather axes keep
    # the pairs whose block is this rank's, the all-to-all axes send each pair to its block
    coords = _coords(torch.div(expert, n_local, rounding_mode="floor"), sizes)
    keep = torch.ones_like(expert, dtype=torch.bool)
    for a, c in zip(axes, coords):
        if a not in dispatch:
            keep &= c == comm.coord[a]
    tok, route = tok[keep], route[keep]
    rows, ids = hidden[tok], expert[keep]
    levels = []
    for a in dispatch:
        dest = _coords(torch.div(ids, n_local, rounding_mode="floor"), sizes)[axes.index(a)]
        order = torch.argsort(dest, stable=True)
        rows, ids = rows[order], ids[order]
        send = torch.bincount(dest, minlength=comm.size(a))
        recv = comm.all_to_all(send, a, 0, 0)
        send, recv = tuple(send.tolist()), tuple(recv.tolist())
        rows = all_to_all_v(rows, a, send, recv)
        ids = all_to_all_v(ids, a, send, recv)
        levels.append((a, order, send, recv))
    local_ids = torch.remainder(ids, n_local).unsqueeze(1)
    ones = torch.ones(local_ids.shape, dtype=top_k_weights.dtype, device=hidden.device)
    rows16, stacks16 = sixteen_bit(rows, stacks, key)
    y = _call(key, n_local, stacks16, rows16, local_ids, ones)
    # y depends on the rows and every stack whatever the routing: a module that computes
    # only the experts some row chose (transformers' do) returns zeros cut off from its
    # input where this rank got no row, so the hidden state's gradient (and under
    # all-to-all, the exchange's backward) would come on some ranks and not on others, and
    # their backward collectives in different orders (the seed-43 sweep's mixtral-skewed
    # case: tests/test_sweep.py); a stack no pair reached still gets its (zero) gradient,
    # as on one device
    anchor = sum(t.reshape(-1)[:1].sum() for t in (rows, *stacks)) * 0
    y = y + anchor.to(y.dtype)
    for a, order, send, recv in reversed(levels):
        y = all_to_all_v(y, a, recv, send)
        y = y[torch.argsort(order)]
    weighted = (y * route.unsqueeze(1).to(y.dtype)).to(hidden.dtype)
    return torch.zeros_like(hidden).index_add(0, tok, weighted)


@torch.library.custom_op(SPLIT_OP_NAME, mutates_args=())
def moe_experts_split(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      stacks: list[torch.Tensor], key: str, axes: list[int],
                      dispatch: list[int]) -> torch.Tensor:
    """:func:`run_experts` as one op of a compiled program, run eagerly (its collectives
    too); its backward runs it again with autograd on, as ``moe_experts``'s does."""
    with torch.no_grad():
        return _run_experts(hidden, top_k_index, top_k_weights, stacks, key, tuple(axes),
                            tuple(dispatch)).clone()


@moe_experts_split.register_fake
def _(hidden, top_k_index, top_k_weights, stacks, key, axes, dispatch):
    return torch.empty_like(hidden)


def _split_setup(ctx, inputs, output):
    hidden, index, weights, stacks, key, axes, dispatch = inputs
    ctx.key, ctx.axes, ctx.dispatch = key, tuple(axes), tuple(dispatch)
    ctx.save_for_backward(hidden, index, weights, *stacks)


def _split_backward(ctx, grad):
    gh, gw, gs = _experts_grads(ctx, grad, ctx.axes, ctx.dispatch)
    # no gradient for key, axes, dispatch: torch wants an empty list for an empty list
    return gh, None, gw, gs, None, [] if not ctx.axes else None, [] if not ctx.dispatch else None


moe_experts_split.register_autograd(_split_backward, setup_context=_split_setup)

SPLIT_OP = torch.ops.autopar.moe_experts_split.default


def _coords(block: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Mixed-radix digits of ``block`` (earlier axis outer)."""
    out = []
    rest = block
    for i in range(len(sizes) - 1, -1, -1):
        out.append(torch.remainder(rest, sizes[i]))
        rest = torch.div(rest, sizes[i], rounding_mode="floor")
    return out[::-1]
