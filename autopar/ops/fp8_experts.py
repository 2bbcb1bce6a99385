"""``precision="fp8"`` for a mixture of experts' expert GEMMs (``autopar::moe_experts``).

DeepSeek-V3 trained its experts' GEMMs in FP8 (DeepSeek-AI 2024, arXiv:2412.19437, Sec. 3.3)
and kept its router in BF16/FP32 (Sec. 3.3.1). Capture records each experts module as one
op (``autopar.ops.experts``) that runs the module's own forward; under fp8 that forward is
:func:`fp8_experts_forward` instead: Hugging Face's eager per-expert loop
(``transformers.integrations.moe``'s reference forward: for each expert its tokens' rows,
``gate_up`` then the module's own ``_apply_gate`` (or ``act_fn``), then ``down``, times the
routing weight, added back at the tokens) with each of the two GEMMs an
:func:`autopar.ops.fp8.fp8_linear` on that expert's slice of the stack: the same recipe, the
same casts and ``_scaled_mm`` as the plan's fp8 linears. The router stays bf16 (it is no
``nn.Linear`` that ``analysis.fp8_layers`` converts, nor part of the experts module).

The layouts it runs: the stacks ``(gate_up_proj, down_proj)`` (gated, ``[gate; up]``
concatenated) or ``(up_proj, down_proj)``, not transposed, without biases or a post-expert
norm (Mixtral, Qwen3-MoE, DeepSeek-V3, OLMoE): :func:`fp8_layout`. Others (GPT-OSS:
interleaved, transposed, with biases) keep bf16 experts: ``analysis.fp8_layers`` does not
offer them.

The scales: each expert's GEMM on a rank scales the rows it receives there (the tokens
routed to it), as torchao's fp8 MoE training scales each expert's group of its grouped GEMM
(``torchao.prototype.moe_training``, ``_scaled_grouped_mm``), and as a dense fp8 linear
scales a rank's rows. One GEMM an expert, whatever the form:

- tokens split (data parallel): the rank's rows for each expert are those of its row
  block, as on one device run per row block (``analysis.fp8_layers.row_blocks``);
- tokens whole on an axis (the all-gather dispatch) or sent to the expert's rank (the
  all-to-all dispatch): an expert's rows come from every rank of that axis, so where that
  axis also splits the batch its scales span those ranks' row blocks together, as on one
  device run on their rows at once (``tests/test_fp8_experts.py`` compares those plans,
  their experts alone in fp8, with one device on the whole batch). Scaling each origin's
  rows apart would match the per-block reference of the dense linears, but costs one GEMM
  and one weight cast per expert and origin: at DeepSeek-V3's 64-way dispatch, GEMMs of
  ~128 rows, memory-bound, slower than bf16's one;
- each expert split (tensor-sharded experts, ``sharding.rules.experts``): ``gate_up``'s
  output rows and ``down``'s input columns are split over the ``tensor_axes``; the weights'
  amaxes (and the activation between them, split on its features) are max-reduced over
  those axes, as ``fp8_linear``'s ``w_shards`` / ``x_shards`` / ``out_shards`` do for a
  column- then row-parallel pair.

How the op learns it is fp8: its ``key`` string (the experts template's, ``ops.experts``)
carries a suffix (:func:`fp8_key`; ``passes/fp8_linears.py`` appends it), so the program's
call, and the opaque ops of a compiled program, need no new argument.
"""
from __future__ import annotations

import torch
from torch import nn

from autopar.ops.fp8 import RECIPES, fp8_linear

SEP = "|fp8="
STACKS = (("gate_up_proj", "down_proj"), ("up_proj", "down_proj"))
"""The stack names (in the module's parameter order) :func:`fp8_experts_forward` runs."""


def fp8_layout(m: nn.Module, names: tuple[str, ...]) -> bool:
    """Whether experts module ``m`` with stacks ``names`` is one :func:`fp8_experts_forward`
    runs (module docstring: the eager loop's layout)."""
    return (names in STACKS and not getattr(m, "is_transposed", True)
            and not getattr(m, "has_bias", True) and not getattr(m, "has_post_expert_norm", False)
            and (names[0] == "up_proj") == (not getattr(m, "has_gate", True))
            and (getattr(m, "is_concatenated", False) or names[0] == "up_proj"))


def fp8_key(key: str, scaling: str, tensor_axes: tuple[int, ...] = ()) -> str:
    """``key`` of an experts op that runs its GEMMs in fp8 under recipe ``scaling``, each
    expert split over mesh ``tensor_axes`` (module docstring)."""
    if scaling not in RECIPES:
        raise ValueError(f"fp8 scaling {scaling!r}: use one of {', '.join(RECIPES)}")
    return f"{key}{SEP}{scaling}:{','.join(map(str, tensor_axes))}"


def parse_key(key: str) -> tuple[str, tuple[str, tuple[int, ...]] | None]:
    """(the template's key, (recipe, tensor axes) or None) of an experts op's ``key``."""
    base, sep, spec = key.partition(SEP)
    if not sep:
        return key, None
    scaling, _, axes = spec.partition(":")
    return base, (scaling, tuple(int(a) for a in axes.split(",") if a))


def fp8_experts_forward(m: nn.Module, stacks: list[torch.Tensor], hidden: torch.Tensor,
                        top_k_index: torch.Tensor, top_k_weights: torch.Tensor, scaling: str,
                        tensor_axes: tuple[int, ...] = (), out_fp32: bool = False) -> torch.Tensor:
    """Experts module ``m``'s forward (``m`` gives the gating: ``_apply_gate`` or ``act_fn``)
    with weights ``stacks`` (up, down) and its two GEMMs per expert in fp8 (module
    docstring). ``out_fp32``: each fp8 GEMM's bf16 output made fp32 (the one-device twin
    with every other op in fp32, ``benchmarks/sweep_fp8.py``)."""
    up, down = stacks
    gated = getattr(m, "has_gate", True)
    w_up = tuple((a, 0) for a in tensor_axes)       # [2I, H]: its output rows split
    w_down = tuple((a, 1) for a in tensor_axes)     # [H, I]: its input columns split
    mid = tuple((a, 1) for a in tensor_axes)        # the rows' inner features split
    out = torch.zeros_like(hidden)
    # every expert, those no token reached too (zero rows): the autograd graph then has the
    # same nodes on every rank, so backward runs them, and the collectives some of them and
    # the program's other branches issue, in the same order on every rank. Skipping them
    # (as the eager loop does) made the order depend on each rank's routing: DeepSeek-V3's
    # experts split over tensor 2 under fp8, one rank at a dense fp8 linear's amax gather
    # while the other all-reduced a gradient (sweep case deepseek_v3-skewed:fp8:856146)
    for e in range(up.shape[0]):
        tok, pos = torch.where(top_k_index == e)
        h = fp8_linear(hidden[tok], up[e], None, scaling, (), w_up, mid)
        h = h.float() if out_fp32 else h
        h = m._apply_gate(h) if gated else m.act_fn(h)
        y = fp8_linear(h, down[e], None, scaling, mid, w_down, ())
        y = y.float() if out_fp32 else y
        y = y * top_k_weights[tok, pos, None]
        out = out.index_add(0, tok, y.to(out.dtype))
    return out


def use_fp8_experts(model: nn.Module, names, scaling: str, out_fp32: bool = False) -> nn.Module:
    """The recipe on one device for experts modules: ``model``'s experts modules named in
    ``names`` (``analysis.fp8_layers.fp8_experts``' values) run :func:`fp8_experts_forward`
    (in place; returns ``model``), as ``ops.fp8.use_fp8_linears`` does for linears."""
    mods = dict(model.named_modules())
    missing = sorted(n for n in names if n not in mods)
    if missing:
        raise ValueError(f"fp8 experts modules the model does not have: {missing}")
    for name in names:
        mod = mods[name]
        stack_names = tuple(n for n, _ in mod.named_parameters())
        if not fp8_layout(mod, stack_names):
            raise ValueError(f"experts module {name!r} ({type(mod).__name__}, stacks "
                             f"{stack_names}) is no layout fp8_experts_forward runs")
        mod.forward = (lambda h, i, w, mod=mod, s=stack_names: fp8_experts_forward(
            mod, [getattr(mod, k) for k in s], h, i, w, scaling, (), out_fp32))
    return model
