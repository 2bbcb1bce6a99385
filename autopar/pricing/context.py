"""The time of a context-parallel attention (``aten.scaled_dot_product_attention`` with its
sequence split on a mesh axis: ``autopar.sharding.rules.attention``, run by
``autopar.ops.context_attention``) under one option.

Work. Each of the axis's ``c`` ranks holds ``L/c`` query rows and attends to every key:
the roofline of the local call with the keys whole (``cost_models.compute``, at the
efficiency its piece pairs and their merges were measured at where the device has one,
``Device.context_attention_efficiency``, else its fused attention's, for the whole
sequence's length). Under ``is_causal`` the runtime skips
the blocks wholly above the diagonal. Under a ``context=`` pin the graph runs the sequence
in the balanced order (``autopar.capture.sequence_layout``: rank ``r`` holds chunks ``r`` and
``2c-1-r``), and every rank does the mean work. Otherwise (a free plan's generic axis) the
layout is contiguous: rank ``c-1``'s queries see ``(2c-1)/(2c)`` of the keys against the
mean's ``1/2``, and the step waits for it: the causal work is multiplied by ``(2c-1)/c``
(``context_attention.causal_work``; 1.97x at c = 32). A boolean mask the graph builds (a
transformers model's) is inspected per block at run time, and blocks it hides whole are
skipped; the planner does not know the mask's values, so a masked attention is priced at
the whole rows' work.

Communication, forms (``Options.context_attention``):

- ``"ring"``: ``c-1`` steps forward, each sending this rank's K/V block (2 tensors of
  ``L/c`` rows) one rank on while the current block is computed (``Comm.shift_start``): a
  step exposes what its transfer takes beyond one block's compute (``1/c`` of the work).
  Backward: the same ``c-1`` K/V transfers behind the blocks' gradients, each beside the
  travelling dK/dV (fp32) of the block just finished, both on the link while the next block
  is computed: a step exposes what the two take beyond one block's backward; the last
  dK/dV transfer (home to the block's owner) has nothing left to hide behind.
- ``"all-gather"``: K and V gathered over the axis forward and again in backward, and
  dK/dV reduce-scattered (fp32): all exposed (no overlap is issued).

Each transfer is priced as one ``send`` of its bytes on the axis's link
(``cost_models.comm.collective_time``), the gathers and reduce-scatters as those
collectives. The form the plan runs is the one pinned, else the faster one summed over
the graph's context-parallel attentions (:func:`best_form`).
"""
from __future__ import annotations

import dataclasses

from autopar.cost_models import comm as comm_model
from autopar.cost_models import compute as compute_model
from autopar.ops.attention import is_attention
from autopar.placement import local_shape
from autopar.sharding.registry import TensorMeta, input_placements, output_placements
from autopar.sharding.rules.attention import context_axes

FORMS = ("ring", "all-gather")
ACC_BYTES = 4             # dK / dV travel and are reduced in float32 (context_attention._acc_dtype)


def context_axis_of(call, combo, mesh_shape) -> int | None:
    """The axis an SDPA option runs context-parallel on, or None."""
    if not is_attention(call.op):
        return None
    axes = [a for a in context_axes(combo, call.inputs[0].ndim) if mesh_shape[a] > 1]
    return axes[0] if axes else None


def context_attention_time(call, combo, axis: int, cost, form: str | None) -> tuple[float, float]:
    """(forward, backward) seconds of one context-parallel SDPA option on ``axis`` of
    ``cost``'s mesh (a ``costing.CostModel``: its mesh, links, device, precision, whether
    the capture is ``native`` and the sequence in the balanced order); ``form`` None: the
    faster of the two."""
    if form is None:
        return min((context_attention_time(call, combo, axis, cost, f) for f in FORMS), key=sum)
    mesh_shape, device, dtype_key, links = cost.mesh_shape, cost.cluster.device, cost.dtype_key, cost.links
    native, balanced = cost.native, cost.context_balanced
    c = mesh_shape[axis]
    ins = [TensorMeta(local_shape(m.shape, input_placements(combo, k), mesh_shape), m.dtype)
           for k, m in enumerate(call.inputs)]
    outs = [TensorMeta(local_shape(m.shape, output_placements(combo, k), mesh_shape), m.dtype)
            for k, m in enumerate(call.outputs)]
    k_local = ins[1]
    whole_kv = [TensorMeta(m.shape[:-2] + (m.shape[-2] * c,) + m.shape[-1:], m.dtype) for m in ins[1:3]]
    key = None if native else dtype_key
    if device.context_attention_efficiency is not None:      # the pairs and their merges, measured
        device = dataclasses.replace(device, attention_efficiency=device.context_attention_efficiency)
    f, b = compute_model.node_time(call.op, [ins[0], *whole_kv, *ins[3:]], outs, call.args,
                                   call.kwargs, device, key, native=native)
    if bool(call.arg(5, "is_causal", False)) and not balanced:
        f, b = f * (2 * c - 1) / c, b * (2 * c - 1) / c
    itemsize = 2 if dtype_key in ("bf16", "fp16") and not native else k_local.dtype.itemsize
    kv_bytes = 2 * k_local.numel * itemsize
    link = links[axis]
    if form == "ring":
        send = comm_model.collective_time("send", kv_bytes, 2, link)
        send_grad = comm_model.collective_time("send", kv_bytes * ACC_BYTES / itemsize, 2, link)
        both = comm_model.collective_time("send", kv_bytes * (1 + ACC_BYTES / itemsize), 2, link)
        f_exp = (c - 1) * max(0.0, send - f / c)
        b_exp = (c - 1) * max(0.0, both - b / c) + send_grad
    else:
        gather = comm_model.collective_time("all_gather", kv_bytes * c, c, link)
        scatter = comm_model.collective_time("reduce_scatter", kv_bytes * c * ACC_BYTES / itemsize,
                                             c, link)
        f_exp, b_exp = gather, gather + scatter
    return f + f_exp, b + b_exp


def best_form(problem, choice: dict, cost) -> str:
    """The form whose summed time over the context-parallel attentions of a solved plan
    (``choice``: node -> its option) is least."""
    totals = {f: 0.0 for f in FORMS}
    for name, v in problem.vars.items():
        if v.kind != "op" or v.call is None:
            continue
        combo = v.options[choice[name]] if isinstance(choice.get(name), int) else choice.get(name)
        if combo is None:
            continue
        axis = context_axis_of(v.call, combo, cost.mesh_shape)
        if axis is None:
            continue
        for f in FORMS:
            t = context_attention_time(v.call, combo, axis, cost, f)
            totals[f] += sum(t) * len(v.members)
    return min(FORMS, key=lambda f: totals[f])
