"""A per-rank program's copy that a rewrite may edit: how the passes that edit a graph in place
(``place_on``, ``fast_bindings``, ``prefetch_gathers``, ``low_precision_gathers``,
``keep_branches``) leave their input as it was (``autopar.runtime.program_passes``).

The copy has its own graph, generated code and submodules (the graph modules it calls, such
as ``passes.recompute``'s checkpointed layers, are copied too: ``place_on`` and
``fast_bindings`` edit them); its parameters, buffers and tensor constants are the input's
own tensors, shared, not copied, so the copy trains the same shards. Node metadata
(``meta["val"]``, ``meta["source"]``) is shared as ``torch.fx.Graph.node_copy`` shares it
(a shallow copy of each node's ``meta`` dict).
"""
from __future__ import annotations

import copy
import itertools

import torch
from torch.fx import GraphModule


def copy_program(gm: GraphModule) -> GraphModule:
    """A copy of ``gm`` whose graphs can be edited without changing ``gm``; every tensor it
    holds (parameters, buffers, constants) is shared with ``gm``."""
    memo: dict[int, object] = {}
    for mod in gm.modules():
        held = itertools.chain(mod._parameters.values(), mod._buffers.values(), vars(mod).values())
        for t in held:
            if isinstance(t, torch.Tensor):
                memo[id(t)] = t
    return copy.deepcopy(gm, memo)
