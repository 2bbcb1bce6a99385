"""What one distinct conversion costs to price (``CommCosts._edge_steps``, issue 40), and how
many a normalised cache key would merge: plan an example on a pinned mesh, then price its
program's table again from empty memos, recording every distinct conversion, and time
pricing them once more.

    python benchmarks/edge_pricing.py                       # the tiny llama, data 2 x tensor 2
    python benchmarks/edge_pricing.py llama '{"tensor": 4}' 1x4xH100

``normalised keys``: the conversions left if the memo's key kept only the tensor dims a
placement of the conversion (source, destination or a step between) shards, the others
multiplied into one (the local byte counts and divisibility, so the prices, would be equal).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from autopar.capture import capture  # noqa: E402
from autopar.cost_models.hardware import parse_cluster  # noqa: E402
from autopar.placement import Shard  # noqa: E402
from autopar.pricing import comm_costs, costing  # noqa: E402
from autopar.pricing.comm_costs import _planned  # noqa: E402
from autopar.solver import ilp  # noqa: E402
from autopar.solver.flat import solve_captured  # noqa: E402


def _normalised(call) -> tuple:
    _, meta, src, dst, gp, bucketed, shared = call
    nd = len(meta.shape)
    if nd == 0:
        return (meta.shape, meta.dtype, src, dst, gp, bucketed, shared)
    touched = {p.dim % nd for p in (*src, *dst) if isinstance(p, Shard)}
    for st in _planned(src, dst, gp) or ():
        if st.kind in ("scatter", "reduce_scatter", "all_to_all"):
            touched.add(st.dim % nd)
    rest = 1
    for d, s in enumerate(meta.shape):
        if d not in touched:
            rest *= s
    shape = tuple(s if d in touched else 1 for d, s in enumerate(meta.shape)) + (rest,)
    return (shape, meta.dtype, src, dst, gp, bucketed, shared)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("example", nargs="?", default="llama", help="a name of examples.models")
    ap.add_argument("pins", nargs="?", default='{"data": 2, "tensor": 2}', help="pins, as JSON")
    ap.add_argument("cluster", nargs="?", default="1x4xH100")
    args = ap.parse_args()
    pins = json.loads(args.pins)
    world = 1
    for d in pins.values():
        world *= d
    from examples.models import EXAMPLES
    ex = EXAMPLES[args.example]()
    cap = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    _, sol = solve_captured(cap, parse_cluster(args.cluster), world, pins=pins)
    calls = []
    real = comm_costs.CommCosts._edge_steps

    def recorded(self, *a):
        calls.append((self, *a))
        return real(self, *a)
    cost = sol.cost
    cost._edge_cache, cost._sync_cache = costing._shared(("bench", 1)), costing._shared(("bench", 2))
    cost._edge_cache.clear(), cost._sync_cache.clear()
    cost._prices = None
    comm_costs.CommCosts._edge_steps = recorded
    c0 = time.process_time()
    ilp.tabulate(sol.problem, cost)
    tab_s = time.process_time() - c0
    comm_costs.CommCosts._edge_steps = real
    c0 = time.process_time()
    for call in calls:
        real(*call)
    each = (time.process_time() - c0) / max(1, len(calls))
    print(f"{args.example} {pins} on {args.cluster}: tabulate {tab_s:.2f} CPU s, "
          f"{len(calls)} distinct conversions, {each * 1e6:.1f} CPU us each; "
          f"normalised keys {len({_normalised(c) for c in calls})}")


if __name__ == "__main__":
    main()
