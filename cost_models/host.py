"""Host time of an eager program on a GPU: the CPU dispatches every ATen op of a step
(forward, the autograd engine's backward, the optimizer's foreach kernels) while the GPU
runs the queued kernels asynchronously, so a step costs about ``max(device, host)``
(``cost_models.step.step_time``), not their sum.

``host = dispatches * GPU_HOST_OP_S``. Dispatches are counted from the captured graph:
each captured ATen op stands for the ATen calls eager PyTorch makes for it, forward and
backward (:data:`DISPATCHES`), and the optimizer adds its foreach calls
(:data:`OPTIMIZER_DISPATCHES`).

Every count is measured, every constant cited; none is fitted to an end-to-end row.

Checked against the GPU check's committed reports (``benchmarks/host_time.py``,
``tests/test_host_time.py``). The search prices it on GPU devices (``Device.host_op_s``)
in every estimate: flat, accumulated, branch, update-scheme and pipelined plans
(``cost_models.step``'s overlap rules say how); CPU devices price none (0).
"""
from __future__ import annotations

from typing import Iterable

# ATen calls an eager step makes per captured node, (forward, backward), by the captured op
# (``str(node.target)`` without ``aten.``): measured on this CPU (torch 2.13, 2026-11-29) by
# running the captured graphs of benchmarks/gpu_check.py's GPT and Llama (their structure:
# 4 layers, 12 / 8 heads, GQA 8/4; the widths do not change the calls) through an fx
# Interpreter under torch.autocast(bfloat16), one TorchDispatchMode counting each ATen call
# and charging it to the fx node running (forward) or to the node whose autograd function
# is running (``torch._C._current_autograd_node``, backward); both models' counts pooled:
# (forward calls, backward calls, captured nodes); ``benchmarks/host_time.py --count``
# measures them again. A linear is ~6 calls forward (autocast casts of input, weight and
# bias, t, addmm or mm, views) and ~12 backward (two mm, t, views, casts back, a bias sum). Totals
# against autopar's runtime counted the same way (its programs, not the Interpreter): GPT
# 186 / 345 against 190 / 345, Llama 487 / 696 against 463 / 696.
_MEASURED = {
    "__and__.Tensor": (2, 0, 2), "_assert_tensor_metadata.default": (24, 0, 24),
    "add.Tensor": (37, 18, 37), "alias.default": (1, 0, 1), "arange.default": (5, 0, 5),
    "arange.start": (1, 0, 1), "cat.default": (9, 16, 9), "cos.default": (1, 0, 1),
    "cross_entropy_loss.default": (8, 8, 2), "cumsum.default": (1, 0, 1),
    "diff.default": (4, 0, 1), "embedding.default": (3, 7, 3), "eq.Tensor": (1, 0, 1),
    "expand.default": (11, 8, 11), "flatten.using_ints": (2, 1, 2), "gelu.default": (4, 4, 4),
    "index.Tensor": (4, 0, 4), "layer_norm.default": (9, 35, 9), "le.Tensor": (1, 0, 1),
    "linear.default": (276, 565, 46), "mean.dim": (9, 18, 9), "mul.Tensor": (41, 128, 41),
    "ne.Scalar": (1, 0, 1), "neg.default": (8, 8, 8), "new_ones.default": (1, 0, 1),
    "pow.Tensor_Scalar": (9, 36, 9), "reshape.default": (24, 16, 16),
    "rsqrt.default": (18, 36, 9), "scaled_dot_product_attention.default": (36, 24, 8),
    "silu.default": (4, 4, 4), "sin.default": (1, 0, 1), "slice.Tensor": (17, 24, 17),
    "split.Tensor": (4, 4, 4), "sub.Tensor": (1, 0, 1), "to.device": (0, 0, 1),
    "to.dtype": (1, 0, 21), "to.dtype_layout": (0, 0, 2), "transpose.int": (32, 32, 32),
    "unsqueeze.default": (30, 8, 30), "view.default": (30, 41, 30),
}
DISPATCHES: dict[str, tuple[float, float]] = {k: (f / n, b / n) for k, (f, b, n) in _MEASURED.items()}
"""Captured op -> (forward, backward) ATen calls per node (:data:`_MEASURED`)."""
DEFAULT_DISPATCHES = (1.0, 1.0)
"""An op the table does not list: one call forward, one backward (its derivative)."""
FREE_TARGETS = ("getitem",)
"""Python-level nodes (tuple indexing) that dispatch nothing."""

# Foreach calls of one optimizer step (torch.optim's default on CUDA, ``foreach=True``),
# by the optimizer's states per parameter (``options.check_optimizer``): SGD 1
# (``_foreach_add_`` of the grads, torch/optim/sgd.py ``_multi_tensor_sgd``); SGD with
# momentum 3 (``_foreach_mul_`` and ``_foreach_add_`` of the buffers, ``_foreach_add_`` of
# the parameters); AdamW 10 (torch/optim/adam.py ``_multi_tensor_adam``: step += 1, weight
# decay mul_, lerp_, mul_, addcmul_, sqrt, div_, add_, bias corrections, addcdiv_).
OPTIMIZER_DISPATCHES = {0: 1, 1: 3, 2: 10}

# Host seconds per ATen call of an eager step on a GPU (GPU_HOST_OP_S, every GPU preset's
# ``Device.host_op_s``), derived from ONE
# measurement: the Llama of benchmarks/gpu_check.py on the H100 report
# (benchmarks/results/gpu_check_nvidia-h100-80gb-hbm3.json, op_timing, the plain step's
# median): 20.278 ms a step, whose device side the cost model puts at 4.33 ms and the
# per-shape kernels (plan_shapes, CUDA events) confirm within 1.1-1.2x, so the step is the
# host's. Its ATen calls by this module's count (benchmarks/host_time.py): 1,208 forward and
# backward + 3 optimizer (SGD with momentum) = 1,211; 20.278 ms / 1,211 = 16.7 us a call.
# The GPT and the H200 reports are the held-out check (benchmarks/host_time.py). It is the
# host CPU's speed (Python, the dispatcher, the autograd engine, a launch), so one figure
# for every GPU preset; the device's own launch gap stays in Device.launch_overhead.
GPU_HOST_OP_S = 20.278e-3 / 1211

# compile=True programs: in the three committed reports autopar's compiled GPT step over
# its eager step (section autopar_compile, median_step_s / autopar_eager_step_s) was
# 11.597 / 11.351 = 1.02 (H100), 5.848 / 7.264 = 0.81 (H200 session 20), 10.642 / 9.036 =
# 1.18 (H200 session 20 final): geometric mean 0.99. Compiled programs paid no less host
# time at this size (Inductor's per-kernel launches, the autograd engine and the eager
# optimizer remain); the reports do not count compiled kernels, so no per-kernel constant
# can be derived. The estimate charges compiled programs this fraction of the eager count.
COMPILED_HOST_FRACTION = 0.99


def node_dispatches(target: str) -> tuple[float, float]:
    """(forward, backward) ATen calls of one captured node whose target is ``target``."""
    name = target.removeprefix("aten.")
    if any(t in name for t in FREE_TARGETS):
        return 0.0, 0.0
    return DISPATCHES.get(name, DEFAULT_DISPATCHES)


def step_dispatches(targets: Iterable[str], recomputed: Iterable[str] = (), *,
                    optimizer_states: int = 2, microbatches: int = 1) -> float:
    """ATen calls of one eager training step: every captured node's forward and backward
    calls per micro-batch, the forward again of each recomputed node, and the optimizer's
    foreach calls once."""
    fwd = bwd = 0.0
    for t in targets:
        f, b = node_dispatches(t)
        fwd, bwd = fwd + f, bwd + b
    again = sum(node_dispatches(t)[0] for t in recomputed)
    return microbatches * (fwd + bwd + again) + OPTIMIZER_DISPATCHES.get(optimizer_states, 10)


# compile="reduce-overhead" (CUDA graphs, Inductor's ``triton.cudagraphs``): each compiled
# program is one graph replay, so the host no longer dispatches its ops one by one. What the
# host still does a step, counted from torch's replay path (torch/_inductor/cudagraph_trees.py,
# ``CUDAGraphNode.run``: each input not at its recorded address copied in, ``graph.replay()``,
# each output rebuilt as a tensor over the graph's pool) and from the autograd engine: the
# forward and the backward replay (one call each), the batch's inputs copied (one each), per
# parameter its gradient rebuilt and accumulated into ``.grad`` (AccumulateGrad: two calls),
# and the eager optimizer's foreach calls (OPTIMIZER_DISPATCHES), each at GPU_HOST_OP_S. Not
# measured yet (no GPU since it was written): the GPU check's autopar_compile section times it
# (``benchmarks/gpu_check.py``, ``compile="reduce-overhead"`` rows).
GRAPH_REPLAYS = 2
"""Graph replays of an unpipelined step: the forward program and the backward program."""
GRAPH_CALLS_PER_PARAM = 2
"""Host calls per parameter of a replayed backward: its gradient rebuilt, then accumulated."""


def graphs_dispatches(inputs: int, params: int, *, optimizer_states: int = 2) -> float:
    """Host calls of one step whose programs are replayed as CUDA graphs (see above):
    ``inputs`` batch tensors copied in, ``params`` gradients rebuilt and accumulated."""
    return (GRAPH_REPLAYS + inputs + GRAPH_CALLS_PER_PARAM * params
            + OPTIMIZER_DISPATCHES.get(optimizer_states, 10))


def host_time(dispatches: float, host_op_s: float, *, compiled: bool = False) -> float:
    """Host seconds of a step of ``dispatches`` ATen calls at ``host_op_s`` each (0 where the
    device prices no host term: CPU ranks carry theirs in ``launch_overhead``)."""
    return dispatches * host_op_s * (COMPILED_HOST_FRACTION if compiled else 1.0)
