"""FP8 linear layers: torchao's float8 training recipes as one autograd function over
``torch._scaled_mm``, with the amax reductions a sharded operand needs.

The recipes (torchao ``float8`` training, ``Float8LinearConfig.from_recipe_name``):

- ``"tensorwise"``: one scale per tensor. Forward ``y = x W^T`` with x and W in
  ``float8_e4m3fn``; backward ``dx = dy W`` and ``dW = dy^T x`` with dy in ``float8_e5m2``
  (range for gradients), the forward's fp8 x reused and W cast again (the same values:
  W, not its cast, is what backward keeps). Scales are fp32, not rounded.
- ``"rowwise"``: one scale per row along each GEMM's contraction dimension, every operand in
  e4m3, scales rounded down to a power of 2 (torchao's ``round_scales_to_power_of_2``):
  forward x per token over K and W per output row over K; dgrad dy per token over N and W
  per input column over N; wgrad dy per output feature over the tokens and x per input
  feature over the tokens. Each operand is cast again for each GEMM from its bf16 copy.

A cast (torchao ``hp_tensor_to_float8_dynamic``): ``amax = max |t|`` over the scaled dims,
``scale = fmax / max(amax, 1e-12)`` (``fmax`` 448 for e4m3, 57344 for e5m2; torchao's
``EPS``), ``t8 = clamp(t * scale, -fmax, fmax)`` in fp32 then to fp8; the GEMM multiplies by
``1 / scale`` of each operand and writes bf16. Everything else runs in bf16 under autocast,
as ``precision="bf16"`` does (``autopar.runtime.precision``): the operands are cast to bf16
first, the output is bf16, the bias is added in bf16.

Under sharding: the amax of an operand sharded on a scaled dim is a max-all-reduce over that
mesh axis (an all-gather of the rank's amaxes, then the max: exact, so every rank and the
unsharded tensor get the same scale). A weight is whole on one device, so every shard of it
is reduced (tensor parallel; a ZeRO-3 weight is gathered before the GEMM, so its amax is
already whole). Under the tensorwise recipe ZeRO-3 gathers it in fp8 instead
(``passes/fp8_gathers.py``): each shard cast with the whole weight's scale
(:func:`weight_scales`), the fp8 bytes gathered, the GEMMs fed the gathered fp8 weight
(:func:`fp8_weight`) with no cast of their own: the same bytes, half the gather's. The
token dims of x and dy (all but the last) are the rows one rank's program sees: a
data-parallel rank, a pipeline micro-batch, scales its own rows, as torchao does under
DDP/FSDP and gradient accumulation; the equal single-device run is the recipe applied per
rank's rows (``tests/fp8_worker.py``).

Why our own function rather than torchao's ``Float8Linear``: autopar's programs are ATen
graphs of ``aten.linear`` on each rank's local tensors, not ``nn.Linear`` modules, and the
amax reductions must run over autopar's mesh axes (``autopar.ops.comm``), where torchao's
distributed support is DTensor / FSDP2's; the arithmetic is ~100 lines over
``torch._scaled_mm``, which runs on CPU in torch 2.13 (tensorwise, rowwise, e4m3 x e5m2),
so tests run the real fp8 GEMMs, and autopar needs no new dependency. torchao 0.14.0
(whose wheel pulls no torch, and whose float8 training runs on torch 2.13's CPU) is the
reference: ``tests/test_fp8.py`` checks this function bit-equal to its ``Float8Linear``
under both recipes (output, dx, dW, db), so it is a test dependency (the dev extra) only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autopar.ops.comm import current_comm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12
"""torchao ``float8_utils.EPS``: the least amax a scale is computed from."""
HP = torch.bfloat16
"""The high precision the rest of an fp8 plan runs in (as ``precision="bf16"``)."""


@dataclass(frozen=True)
class Recipe:
    """One of torchao's float8 training recipes (module docstring)."""
    name: str
    grad_dtype: torch.dtype
    rowwise: bool
    power_of_2: bool


RECIPES = {"tensorwise": Recipe("tensorwise", E5M2, rowwise=False, power_of_2=False),
           "rowwise": Recipe("rowwise", E4M3, rowwise=True, power_of_2=True)}


def _max_over(a: torch.Tensor, axis: int) -> torch.Tensor:
    """The elementwise max of ``a`` over the ranks of mesh ``axis``."""
    comm = current_comm()
    return comm.all_gather(a.unsqueeze(0), axis, 0).amax(dim=0)


def _amax(t: torch.Tensor, dims: tuple[int, ...], shards: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """max |t| over ``dims`` (kept), max-reduced over each mesh axis of ``shards``
    ((axis, dim) pairs: ``t`` sharded on ``dim`` over ``axis``) whose dim is scaled."""
    if any(t.shape[d] == 0 for d in dims):     # no rows (an expert no token reached): 0
        a = torch.zeros([1 if d in dims else n for d, n in enumerate(t.shape)],
                        dtype=torch.float32, device=t.device)
    else:
        a = t.abs().amax(dim=dims, keepdim=True).float()
    for axis, dim in shards:
        if dim % t.dim() in dims:
            a = _max_over(a, axis)
    return a


def _scale(amax: torch.Tensor, dtype: torch.dtype, recipe: Recipe) -> torch.Tensor:
    """The fp32 scale(s) of amax(es) ``amax`` for fp8 ``dtype`` (module docstring)."""
    # in float64 then fp32, as torchao's amax_to_scale (eager and compiled alike)
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=EPS)).float()
    if recipe.power_of_2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def scaled(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` times ``scale``, clamped to fp8 ``dtype``'s range, in ``dtype``."""
    fmax = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype)


def cast(t: torch.Tensor, dtype: torch.dtype, dims: tuple[int, ...], recipe: Recipe,
         shards: tuple[tuple[int, int], ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in fp8 ``dtype`` scaled over ``dims`` (module docstring): (t8, 1 / scale)."""
    scale = _scale(_amax(t, dims, shards), dtype, recipe)
    return scaled(t, scale, dtype), scale.reciprocal()


def weight_scales(shards: list[torch.Tensor], axes: tuple[int, ...]) -> torch.Tensor:
    """The tensorwise recipe's W scales, one for each of ``shards`` (each a rank's block of a
    whole weight split over mesh ``axes``, in ``HP``): of the whole weight's amax, one
    max-reduction of every shard's amax together over each axis. Collective. What ZeRO-3's
    fp8 all-gather casts each shard with (``ops.param_buckets``, ``ops.collectives``): the
    same elementwise cast, with the same scale, as :func:`cast` of the gathered weight."""
    a = torch.stack([s.abs().amax().float() for s in shards])
    for axis in axes:
        a = _max_over(a, axis)
    return _scale(a, E4M3, RECIPES["tensorwise"])


def fp8_weight(w8: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """What a ZeRO-3 fp8 gather gives :func:`fp8_linear`: a bf16 tensor of ``w8``'s shape
    that holds no values (one element, zero strides: autograd's gradient of the weight has
    its shape and dtype) and carries the gathered fp8 weight ``w8`` and its inverse scale
    (``.fp8``), which the GEMMs read as they are. Only an fp8 linear reads it
    (``passes/fp8_gathers.py``)."""
    out = torch.empty_strided(w8.shape, (0,) * w8.dim(), dtype=HP, device=w8.device)
    out.fp8 = (w8, inv_scale.reshape(1, 1))
    return out


def _mm(a8, sa, b8, sb) -> torch.Tensor:
    """``a @ b`` of two scaled fp8 matrices in bf16; ``a`` row-major, ``b`` column-major
    (what ``_scaled_mm`` asks for on CUDA)."""
    a8 = a8.contiguous()
    b8 = b8.t().contiguous().t()
    if sa.numel() == 1 and sb.numel() == 1:
        sa, sb = sa.reshape(()), sb.reshape(())
    sa, sb = (s.reshape(-1).reshape(s.shape) for s in (sa, sb))    # dense strides
    return torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=HP)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, recipe: Recipe, x_shards, w_shards, out_shards, gathered: bool):
        with torch.autocast(x.device.type, enabled=False):
            ctx.recipe, ctx.shards = recipe, (x_shards, w_shards, out_shards)
            ctx.x_dtype, ctx.w_dtype, ctx.x_shape = x.dtype, w.dtype, x.shape
            ctx.b_dtype = None if b is None else b.dtype
            ctx.gathered = gathered
            x2 = x.to(HP).reshape(-1, x.shape[-1])
            xs = _token_free(x_shards, x.dim())     # shards on K only (module docstring)
            # W itself is saved, not a cast of it: the parameter (no copy), or ZeRO-3's
            # gathered weight, which autopar gathers again for backward instead of keeping
            # it (ops.collectives.RegatheredWeights); backward casts it again, alike.
            # ZeRO-3's fp8 gather (``gathered``, tensorwise): W arrives cast, with the whole
            # weight's scale (fp8_weight); forward and dgrad read it as it is, and backward
            # keeps it as it kept W: the gathered fp8 weight, gathered again (in fp8)
            if gathered:
                w8, sw = w.fp8
                x8, sx = cast(x2, E4M3, (0, 1), recipe, xs)
                ctx.save_for_backward(x8, sx, w8, sw)
            elif recipe.rowwise:
                x8, sx = cast(x2, E4M3, (1,), recipe, xs)
                w8, sw = cast(w.to(HP), E4M3, (1,), recipe, w_shards)
                ctx.save_for_backward(x2, w)
            else:
                x8, sx = cast(x2, E4M3, (0, 1), recipe, xs)
                w8, sw = cast(w.to(HP), E4M3, (0, 1), recipe, w_shards)
                ctx.save_for_backward(x8, sx, w)
            y = _mm(x8, sx, w8.t(), sw.t())
            if b is not None:
                y = y + b.to(HP)
            return y          # (tokens, N): ``fp8_linear`` shapes it, outside the Function

    @staticmethod
    def backward(ctx, gy):
        recipe = ctx.recipe
        x_shards, w_shards, out_shards = ctx.shards
        g2 = gy.to(HP).reshape(-1, gy.shape[-1])
        gs = _token_free(out_shards, len(ctx.x_shape))     # shards on N only
        if recipe.rowwise:
            x2, w = ctx.saved_tensors
            wh = w.to(HP)
            g8, sg = cast(g2, recipe.grad_dtype, (1,), recipe, gs)            # dy per token over N
            wc8, swc = cast(wh, E4M3, (0,), recipe, w_shards)                 # W per column over N
            gx = _mm(g8, sg, wc8, swc)
            gt8, sgt = cast(g2, recipe.grad_dtype, (0,), recipe, gs)          # dy per feature over tokens
            xt8, sxt = cast(x2, E4M3, (0,), recipe, ())                       # x per feature over tokens
            gw = _mm(gt8.t(), sgt.t(), xt8, sxt)
        else:
            if ctx.gathered:
                x8, sx, w8, sw = ctx.saved_tensors                      # the forward's, kept
            else:
                x8, sx, w = ctx.saved_tensors
                w8, sw = cast(w.to(HP), E4M3, (0, 1), recipe, w_shards)     # the forward's, again
            g8, sg = cast(g2, recipe.grad_dtype, (0, 1), recipe, gs)
            gx = _mm(g8, sg, w8, sw)
            gw = _mm(g8.t(), sg, x8, sx)
        gb = None if ctx.b_dtype is None else g2.sum(0).to(ctx.b_dtype)
        return (gx.reshape(ctx.x_shape).to(ctx.x_dtype), gw.to(ctx.w_dtype), gb,
                None, None, None, None, None)


def _token_free(shards, ndim: int) -> tuple[tuple[int, int], ...]:
    """The (axis, dim) shards of an activation on its feature (last) dim, as dim 1 of its
    2-D (tokens, features) view: the token dims' shards are per-rank rows (module docstring)."""
    return tuple((axis, 1) for axis, dim in shards if dim % ndim == ndim - 1)


def use_fp8_linears(model: nn.Module, weights: set[str], scaling: str) -> nn.Module:
    """The recipe on one device: ``model``'s ``nn.Linear`` layers whose weight is named in
    ``weights`` (``analysis.fp8_layers.fp8_linears``' values) call :func:`fp8_linear` with
    no shards (in place; returns ``model``). Run it under ``torch.autocast(bfloat16)``, on
    the row blocks a plan's ranks and micro-batches scale alone
    (``analysis.fp8_layers.row_blocks``), for the numbers the plan's run computes."""
    found = set()
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and f"{name}.weight" in weights:
            mod.forward = (lambda x, mod=mod: fp8_linear(x, mod.weight, mod.bias, scaling))
            found.add(f"{name}.weight")
    if found != set(weights):
        raise ValueError(f"fp8 weights that are no nn.Linear layer's: {sorted(set(weights) - found)}")
    return model


def fp8_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
               scaling: str = "tensorwise", x_shards=(), w_shards=(), out_shards=(),
               w_fp8: bool = False) -> torch.Tensor:
    """``aten.linear(x, w, b)`` with its three GEMMs in fp8 under recipe ``scaling``.
    ``x_shards`` / ``w_shards`` / ``out_shards``: (mesh axis, dim) pairs, each a dim of x,
    W or the output (whose gradient dy is sharded so) that this rank holds a shard of on
    that axis (``passes/fp8_linears.py`` reads them from the plan); empty on one device.
    ``w_fp8``: ``w`` is ZeRO-3's fp8 gather of the weight (:func:`fp8_weight`, tensorwise
    only; ``passes/fp8_gathers.py``), already cast with the whole weight's scale."""
    if scaling not in RECIPES:
        raise ValueError(f"fp8 scaling {scaling!r}: use one of {', '.join(RECIPES)}")
    if w_fp8 and (scaling != "tensorwise" or getattr(w, "fp8", None) is None):
        raise ValueError(f"fp8_linear(w_fp8=True) under {scaling!r} with a weight that is no "
                         "fp8 gather's (ops.fp8.fp8_weight): only the tensorwise recipe's "
                         "ZeRO-3 gather gives one (passes/fp8_gathers.py)")
    # the Function returns its 2-D product and the reshape runs outside it: an output that is
    # a view made inside a custom Function may not be changed in place ("Output 0 of
    # _Fp8Linear is a view and is being modified inplace": Llama 4's text model adds into
    # a projection's output), one made by an ordinary reshape may
    y = _Fp8Linear.apply(x, w, b, RECIPES[scaling], tuple(map(tuple, x_shards)),
                         tuple(map(tuple, w_shards)), tuple(map(tuple, out_shards)), w_fp8)
    return y.reshape(*x.shape[:-1], y.shape[-1])
