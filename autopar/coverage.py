"""Which ops of a model have a sharding rule, before anything is solved."""
from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

from autopar.capture import capture
from autopar.sharding.registry import has_rule


@dataclass(frozen=True)
class Coverage:
    covered: dict[str, int]        # op -> node count
    missing: dict[str, list[str]]  # op -> node names (these run replicated)

    @property
    def ok(self) -> bool:
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
    return Coverage(dict(covered), missing)

