"""Ops of a captured graph whose forward reads statistics over the batch: BatchNorm in
training mode (``aten.batch_norm`` and its native forms with ``training=True``), whose mean
and variance are taken over every sample (and every position) of its input.

Such a graph trained in micro-batches (gradient accumulation, a pipeline's micro-batches)
normalizes each micro-batch by its own statistics: the numbers of torch's own accumulation,
not those of one step over the whole batch. A split of the batch over a data axis keeps
them (the sharding rule sums the statistics over the axis), micro-batches cannot. So the
free search never chooses micro-batches for such a graph; pinned, they run as asked
(``autopar.solver.accumulate.may_accumulate``, ``free_search.may_pipeline``).
"""
from __future__ import annotations

import torch

from autopar.capture import Captured

BATCH_NORMS = ("batch_norm", "native_batch_norm", "_native_batch_norm_legit",
               "_native_batch_norm_legit_functional", "cudnn_batch_norm", "miopen_batch_norm")
"""ATen ops (by name) that normalize by batch statistics when their ``training`` is true."""


def batch_statistics_nodes(cap: Captured) -> list[str]:
    """The nodes of ``cap`` that normalize by statistics of the batch (module docstring)."""
    out = []
    for n in cap.gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        schema = n.target._schema
        if schema.name.split("::")[-1] not in BATCH_NORMS:
            continue
        names = [a.name for a in schema.arguments]
        if "training" not in names:
            continue
        k = names.index("training")
        training = n.args[k] if k < len(n.args) else n.kwargs.get("training", False)
        if training:
            out.append(n.name)
    return out


__all__ = ["BATCH_NORMS", "batch_statistics_nodes"]
