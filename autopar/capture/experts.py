"""Capture each experts module of a mixture of experts as one ``autopar::moe_experts`` op.

Exported as it is, a Hugging Face experts module becomes a sort of the token-expert pairs,
``histc`` counts, a cumulative sum and ``transformers::grouped_mm_fallback`` calls (or, with
``experts_implementation="eager"``, a Python loop over the experts the example batch
happened to reach, which bakes that routing into the graph). Neither can be split by expert.
While :func:`experts_as_ops` is active, the forward of every experts class in the model is
the op instead (``autopar.ops.experts``): one node per MoE layer, routing-independent, whose
sharding rules know it is a sum over experts. The class's own forward is restored on exit
and is what the op runs.
"""
from __future__ import annotations

import contextlib
import threading

from torch import nn

from autopar.ops.experts import EXPERTS_OP, is_experts_module, template_key

_PATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def experts_as_ops(model: nn.Module):
    """Within the block, the experts modules of ``model`` call the experts op."""
    found = [m for m in model.modules() if is_experts_module(m)]
    if not found:
        yield 0
        return
    with _PATCH_LOCK:
        classes = {}
        for m in found:
            cls = type(m)
            classes.setdefault(cls, cls.__dict__.get("forward", cls.forward))
        keys = {id(m): template_key(m, classes[type(m)]) for m in found}
        for cls, own in classes.items():
            cls.forward = _stand_in(own, keys)
        try:
            yield len(found)
        finally:
            for cls, own in classes.items():
                cls.forward = own


def _stand_in(own, keys: dict[int, str]):
    def forward(self, hidden_states, top_k_index=None, top_k_weights=None, *args, **kwargs):
        key = keys.get(id(self))
        if key is None or args or kwargs or top_k_index is None or top_k_weights is None:
            return own(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        stacks = [p for _, p in self.named_parameters()]
        return EXPERTS_OP(hidden_states, top_k_index, top_k_weights, stacks, key)
    forward.__wrapped__ = own
    return forward


def expert_stacks(gm) -> frozenset[str]:
    """Names of the graph's nodes that an experts op reads as weight stacks."""
    out = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is EXPERTS_OP:
            out.update(a.name for a in n.args[3])
    return frozenset(out)
