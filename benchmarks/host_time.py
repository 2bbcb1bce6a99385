"""Host time of eager programs on a GPU, against the committed GPU check reports (issue 39,
item 2): the check's GPT and Llama, their predicted step before (device side only) and
after (``max(device, host)``, ``cost_models.host``) against the measured step.

Run, from the repository root::

    PYTHONPATH=. python benchmarks/host_time.py            # the table, from the reports
    PYTHONPATH=. python benchmarks/host_time.py --count    # the dispatch counts, measured here

The device side is the report's own prediction (``op_timing``'s ``step`` row: the plan's
estimate on that GPU when the check ran); the host side is this commit's count of the
model's ATen calls (its graph captured here, on the CPU, at the check's layer and head
structure with narrow widths, which do not change the calls) times
``cost_models.host.GPU_HOST_OP_S``. That constant was derived from the Llama on the H100
report alone; every other row is held out.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
REPORTS = ("gpu_check_nvidia-h100-80gb-hbm3.json", "gpu_check_nvidia-h200_session20.json",
           "gpu_check_nvidia-h200_session20_final.json")
"""The committed reports with an ``op_timing`` section (plain eager steps of both models)."""
DERIVED_FROM = ("gpu_check_nvidia-h100-80gb-hbm3.json", "llama")
NARROW = {"gpt": {"n_embd": 96, "block_size": 32, "vocab_size": 256, "batch": 2},
          "llama": {"hidden_size": 64, "intermediate_size": 128, "seq": 32, "vocab_size": 256, "batch": 2}}
"""Widths shrunk, layers, heads and key-value heads kept (the calls depend on those)."""


def _models():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check_ops as go
    return go


def narrow_model(name: str):
    """(model, loss_fn, x, y) of the check's ``name`` at its structure, narrow widths."""
    go = _models()
    go.MODELS.setdefault("narrow", {})[name] = dict(go.MODELS["gpu"][name], **NARROW[name])
    model, loss_fn, batch, seq, vocab = go.build_model(name, "narrow")
    (x, y), = go.batches(1, batch, seq, vocab)
    return model, loss_fn, x, y


def dispatches(name: str, optimizer_states: int = 1) -> float:
    """ATen calls of one eager step of the check's model ``name`` by ``cost_models.host``
    (SGD with momentum: one state)."""
    from autopar.capture import capture
    from autopar.cost_models.host import step_dispatches
    model, loss_fn, x, y = narrow_model(name)
    cap = capture(model, (x,), loss_fn, y)
    return step_dispatches([str(n.target) for n in cap.gm.graph.nodes if n.op == "call_function"],
                           optimizer_states=optimizer_states)


def rows(reports=REPORTS) -> list[dict]:
    """Per report and model: measured step, predicted before and after."""
    from autopar.cost_models.host import GPU_HOST_OP_S
    from autopar.cost_models.step import step_time
    calls = {m: dispatches(m) for m in ("gpt", "llama")}
    out = []
    for rep in reports:
        d = json.loads((RESULTS / rep).read_text())
        for m in ("gpt", "llama"):
            step = next(r for r in d["sections"]["op_timing"]["models"][m]["timing_report_dict"]["rows"]
                        if r["name"] == "step")
            host = calls[m] * GPU_HOST_OP_S
            after = step_time(step["predicted"], host)
            out.append({"report": rep, "model": m, "measured_s": max(step["measured"]),
                        "before_s": step["predicted"], "host_s": host, "calls": calls[m], "after_s": after,
                        "error_before": step["predicted"] / max(step["measured"]) - 1,
                        "error_after": after / max(step["measured"]) - 1,
                        "held_out": (rep, m) != DERIVED_FROM})
    return out


def count(name: str) -> dict:
    """(forward, backward, nodes) ATen calls by captured op of one eager step of ``name``,
    measured: the captured graph run by an fx Interpreter under autocast(bfloat16), each
    call charged to the node running (forward) or whose autograd function runs (backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from autopar.capture import capture
    model, loss_fn, x, y = narrow_model(name)
    cap = capture(model, (x,), loss_fn, y)
    grad_fns: dict = {}

    class Calls(TorchDispatchMode):
        node, fwd, bwd = None, Counter(), Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            g = torch._C._current_autograd_node()
            if g is None:
                self.fwd[self.node] += 1
            else:
                self.bwd[grad_fns.get(g, "?")] += 1
            return func(*args, **(kwargs or {}))

    calls = Calls()

    class Run(torch.fx.Interpreter):
        def run_node(self, n):
            calls.node = str(n.target)
            out = super().run_node(n)
            todo = [t.grad_fn for t in torch.utils._pytree.tree_leaves(out)
                    if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            while todo:                       # the autograd functions this node made
                g = todo.pop()
                if g is not None and g not in grad_fns:
                    grad_fns[g] = calls.node
                    todo += [f for f, _ in g.next_functions]
            return out

    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    args = [params[cap.params[n.name][0]] if n.name in cap.params else buffers[cap.buffers[n.name]]
            for n in cap.gm.graph.nodes if n.op == "placeholder" and n.name not in cap.inputs] + [x, y]
    with calls:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = Run(cap.gm).run(*args)
        (out[0] if isinstance(out, (tuple, list)) else out).backward()
    nodes = Counter(str(n.target) for n in cap.gm.graph.nodes if n.op == "call_function")
    return {k.removeprefix("aten."): (calls.fwd.get(k, 0), calls.bwd.get(k, 0), n) for k, n in sorted(nodes.items())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", action="store_true", help="measure the ATen calls per captured op here")
    args = ap.parse_args(argv)
    if args.count:
        for m in ("gpt", "llama"):
            got = count(m)
            print(f"{m}: forward {sum(f for f, _, _ in got.values())}, backward {sum(b for _, b, _ in got.values())}")
            for k, v in got.items():
                print(f"  {k:45s} {v}")
        return 0
    print(f"{'report':45s} {'model':6s} {'calls':>6s} {'measured':>9s} {'before':>9s} {'host':>9s} "
          f"{'after':>9s} {'err before':>10s} {'err after':>9s}")
    for r in rows():
        print(f"{r['report']:45s} {r['model']:6s} {r['calls']:6.0f} {r['measured_s'] * 1e3:7.2f}ms "
              f"{r['before_s'] * 1e3:7.2f}ms {r['host_s'] * 1e3:7.2f}ms {r['after_s'] * 1e3:7.2f}ms "
              f"{r['error_before']:+10.0%} {r['error_after']:+9.0%}" + ("" if r["held_out"] else "  (derived from)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
