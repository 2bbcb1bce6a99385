"""Which values of a captured fp32 graph run in 16 bits under mixed precision, as
``torch.autocast`` runs them (``autopar.runtime.precision``: the runtime's forward is under
autocast on the rank's device).

autocast does not make a graph 16-bit. It casts the floating inputs of the ops of its
lower-precision list to 16 bits and runs them so (matrix products, convolutions,
attention), runs the ops of its fp32 list in fp32, and leaves every other op to type
promotion: an op with an fp32 tensor input (not a 0-dim one beside larger ones) computes
in fp32. A transformer's residual stream, its norms and its rotary products stay fp32; its
projections' and attention's outputs are 16-bit.

Its casts matter to memory. A matrix product saves the 16-bit copy of its input for
backward, and autocast keeps no cache of activations' casts (only of parameters':
``params``, the 16-bit weight copies), so an fp32 value read by three projections (a
Llama layer's normalised input: q, k and v) is copied three times and each copy saved,
beside the fp32 value where an fp32 op saves it too. Measured: Llama-3-8B's rank under
``tensor=8`` at 8,192 tokens kept 0.53-0.57 GiB a layer for backward (on an H200,
``benchmarks/gpu_check.py``'s scale section, 2026-11-30; 0.565 on the CPU, the same
section's trace at 2 and 4 layers), against 0.24 when every activation was counted as
16-bit.

The lists are torch's (``aten/src/ATen/autocast_mode.cpp``, ``AT_FORALL_LOWER_PRECISION_FP``
and ``AT_FORALL_FP32`` / ``AT_FORALL_FP32_SET_OPT_DTYPE`` for CUDA), by the op names the
captured graphs hold; a GPU's lists are used for every device (CPU ranks' differ in a few
ops, e.g. softmax, which their autocast leaves to promotion).
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Node
from torch.utils import _pytree as pytree

LOWER_PRECISION = frozenset({
    "linear", "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "einsum", "mv", "addmv",
    "addr", "chain_matmul", "linalg_vecdot", "prelu", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "convolution", "_convolution",
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
})
"""Ops autocast runs in 16 bits, casting their floating inputs."""

FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "norm", "frobenius_norm", "nuclear_norm", "cosine_similarity", "nll_loss",
    "nll_loss_nd", "nll_loss_forward", "cross_entropy_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "binary_cross_entropy_with_logits", "cdist",
    "logsumexp", "prod", "softmax", "_softmax", "log_softmax", "_log_softmax", "cumprod",
    "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum",
})
"""Ops autocast runs in fp32 (casting 16-bit inputs up)."""

CASTS = frozenset({"to", "_to_copy", "type_as"})


def sixteen_bit_values(gm, params: set[str], op_name) -> set[tuple[str, int]]:
    """The (node name, output index) of every floating value of ``gm`` (captured in fp32)
    that runs in 16 bits under autocast; ``params``: the parameters' placeholders (fp32
    master weights; their 16-bit copies are not values of the graph); ``op_name``: a node
    target's ATen op name (``analysis.saved.op_name``)."""
    low: set[tuple[str, int]] = set()

    def value(a: Node) -> tuple[str, int]:
        if a.op == "call_function" and a.target is operator.getitem:
            src, k = a.args
            return value(src)[0], k
        return a.name, 0

    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        outs = _floating_outputs(node)
        if not outs:
            continue
        name = op_name(node.target)
        if name in LOWER_PRECISION:
            sixteen = True
        elif name in FP32:
            sixteen = False
        elif name in CASTS:
            dtype = _dtype_arg(node)
            if dtype is not None:    # to(dtype): that dtype, whatever the input runs in
                sixteen = dtype in (torch.bfloat16, torch.float16)
            else:                    # to(device), type_as: as the input
                sixteen = _promotes_to_16(node, low, value)
        else:
            sixteen = _promotes_to_16(node, low, value)
        if sixteen:
            low.update((node.name, k) for k in outs)
    return low


def _floating_outputs(node: Node) -> list[int]:
    return [k for k, v in enumerate(pytree.tree_leaves(node.meta.get("val")))
            if isinstance(v, torch.Tensor) and v.dtype.is_floating_point]


def _tensor_inputs(node: Node) -> list[Node]:
    return [a for a in pytree.tree_leaves((node.args, dict(node.kwargs)),
                                          is_leaf=lambda x: isinstance(x, Node))
            if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _dtype_arg(node: Node):
    """The dtype a cast names (``to(x, torch.float32)``, ``_to_copy(x, dtype=...)``), or None."""
    for a in (*node.args[1:], *node.kwargs.values()):
        if isinstance(a, torch.dtype):
            return a
    return None


def _promotes_to_16(node: Node, low, value) -> bool:
    """Type promotion over the floating tensor inputs as they run: 16-bit when every one
    is (a 0-dim tensor beside a larger one does not promote); an op with none keeps the
    capture's fp32."""
    floats = [a for a in _tensor_inputs(node) if a.meta["val"].dtype.is_floating_point]
    if not floats:
        return False
    dims = [a for a in floats if a.meta["val"].dim() > 0]
    return all(value(a) in low for a in (dims or floats))
