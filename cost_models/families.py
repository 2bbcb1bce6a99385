"""Op families: which costing rule an ATen op follows (matmul, view, norm, ...).

:func:`family` maps an op to one of the constants below by its name; ops no family lists
are costed as elementwise, and the ones not known to be elementwise are kept in
``UNKNOWN_OPS`` for the coverage report.
"""
from __future__ import annotations

import operator
from typing import Any

VIEW, MATMUL, CONV, ATTENTION, NORM, RMS_NORM, SOFTMAX, CE_LOSS, NLL_LOSS, MSE_LOSS, \
    ELEMENTWISE, BINARY, ADD, DROPOUT, REDUCTION, EMBEDDING, COPY, FACTORY = range(18)

_FAMILIES: dict[int, tuple[str, ...]] = {
    VIEW: ("view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute",
           "expand", "expand_as", "squeeze", "unsqueeze", "split", "split_with_sizes",
           "unsafe_split", "chunk", "unbind", "slice", "select", "narrow", "alias", "detach",
           "view_as", "flatten", "unflatten", "as_strided", "getitem", "movedim", "swapaxes",
           "swapdims", "numpy_T", "mT", "lift_fresh", "sym_size", "sym_numel", "sym_stride",
           "_assert_async", "_assert_scalar", "_assert_tensor_metadata",
           "_functional_assert_async", "_set_grad_enabled", "dim", "size", "output",
           "broadcast_to", "real", "view_as_real", "view_as_complex", "tensor_split",
           "hsplit", "vsplit", "diagonal", "align_to", "unfold", "contiguous_view",
           "broadcast_tensors"),
    MATMUL: ("mm", "bmm", "matmul", "linear", "addmm", "baddbmm", "addbmm", "mv", "addmv",
             "dot", "vdot", "einsum", "_addmm_activation", "outer", "ger", "_int_mm"),
    CONV: ("convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
           "conv_transpose2d", "conv_transpose3d", "cudnn_convolution",
           "mkldnn_convolution", "_convolution_mode", "conv_tbc"),
    ATTENTION: ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math"),
    NORM: ("layer_norm", "native_layer_norm", "batch_norm", "native_batch_norm",
           "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
           "_native_batch_norm_legit_functional", "group_norm", "native_group_norm",
           "instance_norm", "_batch_norm_with_update", "_batch_norm_no_update"),
    RMS_NORM: ("rms_norm", "_fused_rms_norm"),
    SOFTMAX: ("softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"),
    CE_LOSS: ("cross_entropy_loss",),
    NLL_LOSS: ("nll_loss", "nll_loss_forward", "nll_loss2d", "nll_loss2d_forward",
               "nll_loss_nd"),
    MSE_LOSS: ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
               "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
               "soft_margin_loss"),
    BINARY: ("mul", "div", "true_divide", "floor_divide", "pow", "maximum", "minimum",
             "where", "lerp", "addcmul", "addcdiv", "atan2", "fmod", "remainder", "hypot",
             "xlogy", "copysign", "mul_", "div_"),
    ADD: ("add", "sub", "rsub", "add_", "sub_"),
    DROPOUT: ("dropout", "native_dropout", "feature_dropout", "alpha_dropout",
              "feature_alpha_dropout", "dropout_"),
    REDUCTION: ("sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean",
                "std_mean", "norm", "linalg_vector_norm", "prod", "logsumexp", "argmax",
                "argmin", "any", "all", "cumsum", "cumprod", "nansum", "nanmean",
                "count_nonzero", "aminmax", "frobenius_norm", "sort", "topk", "median",
                "argsort", "kthvalue", "mode", "cummax", "cummin", "logcumsumexp",
                # pooling: one read of every input element (exact for stride = kernel)
                "avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d",
                "max_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices",
                "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
                "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
                "_adaptive_avg_pool2d"),
    EMBEDDING: ("embedding", "embedding_bag", "_embedding_bag"),
    COPY: ("clone", "_to_copy", "to", "copy", "copy_", "contiguous", "cat", "concat",
           "split_with_sizes_copy",
           "concatenate", "stack", "hstack", "vstack", "index_select", "gather", "scatter",
           "scatter_add", "scatter_reduce", "index", "index_put", "index_put_",
           "index_add", "masked_fill", "masked_fill_", "masked_scatter", "masked_select",
           "constant_pad_nd", "pad", "reflection_pad1d", "reflection_pad2d",
           "replication_pad1d", "replication_pad2d", "repeat", "repeat_interleave", "tile",
           "tril", "triu", "flip", "roll", "fill", "fill_", "zero_", "type_as",
           "_to_dtype", "lift_fresh_copy", "slice_scatter", "select_scatter",
           "diagonal_scatter", "as_strided_scatter", "clamp_", "expand_copy",
           "permute_copy", "view_copy", "transpose_copy", "t_copy", "unsqueeze_copy",
           "squeeze_copy", "alias_copy", "detach_copy", "_unsafe_index", "take", "select_copy", "slice_copy", "split_copy",
           "one_hot"),
    FACTORY: ("arange", "zeros", "ones", "full", "empty", "empty_like", "zeros_like",
              "ones_like", "full_like", "rand", "randn", "randint", "rand_like",
              "randn_like", "randint_like", "scalar_tensor", "new_zeros", "new_ones",
              "new_full", "new_empty", "new_empty_strided", "empty_strided", "linspace",
              "logspace", "eye", "tensor", "bernoulli", "normal", "uniform", "randperm",
              "empty_permuted", "_local_scalar_dense", "item"),
}
_FAMILY_OF_NAME = {name: fam for fam, names in _FAMILIES.items() for name in names}
MATMUL_LIKE = frozenset((MATMUL, CONV, ATTENTION))

#: Op names seen that no family lists; they are costed as elementwise ops. Kept so a
#: coverage report can list them.
UNKNOWN_OPS: set[str] = set()

_family_cache: dict[Any, int] = {}


def op_name(op) -> str:
    """``"mm"`` for ``aten.mm.default``; the function name for a Python callable."""
    packet = getattr(op, "_overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(op, "__name__", str(op))


def family(op) -> int:
    """The op's family constant (``MATMUL``, ``VIEW``, ...); unknown ops are elementwise."""
    fam = _family_cache.get(op)
    if fam is None:
        name = op_name(op)
        fam = _FAMILY_OF_NAME.get(name)
        if fam is None:
            if op is operator.getitem:
                fam = VIEW
            else:
                fam = ELEMENTWISE
                if name not in _KNOWN_ELEMENTWISE:
                    UNKNOWN_OPS.add(name)
        _family_cache[op] = fam
    return fam


# Pointwise ops that need no entry above (they are the ELEMENTWISE default); listed only so
# that UNKNOWN_OPS stays meaningful.
_KNOWN_ELEMENTWISE = frozenset((
    "relu", "relu_", "gelu", "silu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "neg",
    "abs", "sin", "cos", "erf", "pow", "reciprocal", "clamp", "clamp_min", "clamp_max",
    "hardtanh", "leaky_relu", "elu", "softplus", "mish", "hardswish", "hardsigmoid", "log1p",
    "expm1", "sign", "floor", "ceil", "round", "trunc", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_not", "logical_and", "logical_or", "bitwise_not", "bitwise_and", "bitwise_or",
    "bitwise_xor", "isnan", "isinf", "nan_to_num", "square", "sigmoid_", "gelu_", "silu_",
    "relu6", "threshold", "glu", "logit", "erfinv", "exp2", "log2", "log10", "frac",
    "_log_softmax_backward_data", "sgn", "heaviside", "acos", "asin", "atan", "tan",
    "cosh", "sinh", "celu", "selu", "erfc", "fmax", "fmin", "isfinite", "logical_xor",
    "positive", "threshold_backward", "upsample_bilinear2d", "upsample_nearest1d",
    "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d", "upsample_bicubic2d",
))
