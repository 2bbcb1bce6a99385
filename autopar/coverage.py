"""Which ops of a model have a sharding rule, before anything is solved."""
from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

from autopar.capture import capture
from autopar.sharding.registry import has_rule


@dataclass(frozen=True)
class Coverage:
    covered: dict[str, int]        # op -> node count
    missing: dict[str, list[str]]  # op -> node names (these run replicated)
    gaps: dict[str, list[str]] = field(default_factory=dict)   # known missing rule -> nodes

    @property
    def ok(self) -> bool:
        """Every op has a rule (known gaps such as fused projections are listed apart)."""
        return not self.missing

    def __str__(self) -> str:
        lines = [f"{sum(self.covered.values())} nodes with a sharding rule "
                 f"({len(self.covered)} ops)"]
        if self.missing:
            lines.append("ops without a rule (they run replicated: correct, maybe slow):")
            for op, nodes in sorted(self.missing.items()):
                more = f" (+{len(nodes) - 3} more)" if len(nodes) > 3 else ""
                lines.append(f"  {op}: {', '.join(nodes[:3])}{more}")
        else:
            lines.append("every op has a rule")
        for gap, nodes in self.gaps.items():
            more = f" (+{len(nodes) - 3} more)" if len(nodes) > 3 else ""
            lines.append(f"missing rule: {gap}: {', '.join(nodes[:3])}{more}")
        return "\n".join(lines)


def coverage(model, example_inputs: Sequence, loss_fn: Callable | None = None, *,
             target=None) -> Coverage:
    """List every op of the captured model that has no sharding rule.

    >>> print(autopar.coverage(model, (x,)))
    """
    cap = capture(model, example_inputs, loss_fn, target)
    covered, missing = Counter(), {}
    for n in cap.gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        if has_rule(n.target) or not n.all_input_nodes:   # factories (arange, zeros): replicated, sliced for free
            covered[str(n.target)] += 1
        else:
            missing.setdefault(str(n.target), []).append(n.name)
    return Coverage(dict(covered), missing, _fused_projection_gaps(cap))


FUSED = ("fused projection split (a linear whose output is split into q, k, v): a column "
         "shard would cut mid-head and needs a strided shard, which autopar does not have "
         "yet; these splits run on gathered or batch/sequence-sharded tensors (correct, slower)")


def _fused_projection_gaps(cap) -> dict[str, list[str]]:
    import torch
    aten = torch.ops.aten
    split_ops = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
                 aten.unbind.int}
    nodes = []
    for n in cap.gm.graph.nodes:
        if n.op == "call_function" and n.target in split_ops:
            src = n.args[0]
            val = src.meta.get("val")
            dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
            if (isinstance(src, torch.fx.Node) and src.target in (aten.linear.default, aten.addmm.default)
                    and val is not None and dim % val.ndim == val.ndim - 1):
                nodes.append(n.name)
    return {FUSED: nodes} if nodes else {}
