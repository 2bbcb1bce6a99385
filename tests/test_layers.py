"""The package's imports point down only: no circles, no upward arrows, imports at the top.

The layers, bottom to top (a module may import its own layer and the ones below):

    bottom    placement, ops (collectives, local ops, stage ops), schedule, device, errors
    data      capture, options, plan (+ plan_schema, report), cost_models, analysis
    rules     sharding
    pricing   pricing (each op's sharding choices, the cost model, a plan's prices, the
              pipeline timeline)
    deciding  solver (ILP, stage DP, pipeline search, the one driver)
    doing     passes, runtime
    face      api, cli, viz, verify, first_step, coverage, checkpoint, the package itself

Deciding never imports doing, and nothing imports the face's entry points (api, cli). The
runtime and the viewer read a plan and its prices, never the solver that made it: no
module of ``autopar.runtime`` or ``autopar.viz`` imports ``autopar.solver``.
The imports are read from the source with ``ast``, so the test sees lazy imports too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"autopar": ROOT / "autopar", "autopar.cost_models": ROOT / "cost_models",
           "autopar.passes": ROOT / "passes"}

LAYERS = [
    ("bottom", ["autopar.placement", "autopar.ops", "autopar.schedule", "autopar.device",
                "autopar.errors"]),
    ("data", ["autopar.capture", "autopar.options", "autopar.mesh_roles", "autopar.update_schemes", "autopar.plan", "autopar.plan_schema", "autopar.report",
              "autopar.cost_models", "autopar.analysis"]),
    ("rules", ["autopar.sharding"]),
    ("pricing", ["autopar.pricing"]),
    ("deciding", ["autopar.solver"]),
    ("doing", ["autopar.passes", "autopar.runtime"]),
    ("face", ["autopar.api", "autopar.cli", "autopar.__main__", "autopar.viz", "autopar.verify", "autopar.first_step",
              "autopar.verify_worker", "autopar.coverage", "autopar.checkpoint", "autopar"]),
]
ENTRY_POINTS = ("autopar.api", "autopar.cli")
# optional heavy dependencies may be imported where they are used (each says so in a comment)
# torch._inductor: 3 s to import, needed only under compile=True (runtime.collective_order)
# datasets: optional beside transformers (integrations.transformers reads a Dataset's columns)
LAZY_OK = ("matplotlib", "pydot", "rich", "transformers", "torch.distributed.pipelining",
           "torchvision", "safetensors", "IPython", "graphviz", "torch._inductor", "datasets")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            if pkg == "autopar" and parts and parts[0] in ("cost_models", "passes"):
                continue
            mods[".".join([pkg, *parts])] = path
    return mods


MODULES = _modules()


def _imports(path: Path):
    """(imported autopar module, line, inside a function or class) for every import."""
    tree = ast.parse(path.read_text())
    nested = {id(n) for top in tree.body if isinstance(top, (ast.FunctionDef, ast.ClassDef,
                                                             ast.AsyncFunctionDef))
              for n in ast.walk(top)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            out += [(n if n in MODULES else node.module, node.lineno, id(node) in nested) for n in names]
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in nested) for a in node.names]
    return out


def _layer(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    if rank is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return rank


def _type_checking_only(path: Path) -> set[int]:
    """Lines of imports under ``if TYPE_CHECKING:`` (annotations only, never executed)."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            lines |= {n.lineno for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def _edges():
    for mod, path in MODULES.items():
        skip = _type_checking_only(path)
        for target, line, nested in _imports(path):
            if target.startswith("autopar") and line not in skip:
                yield mod, target, line, nested


def test_every_module_has_a_layer():
    for mod in MODULES:
        _layer(mod)


def test_no_upward_imports():
    up = [f"{m}:{line} imports {t} ({LAYERS[_layer(m)][0]} -> {LAYERS[_layer(t)][0]})"
          for m, t, line, _ in _edges() if _layer(t) > _layer(m)]
    assert not up, "imports that point up:\n" + "\n".join(up)


def test_nothing_imports_the_entry_points():
    bad = [f"{m}:{line} imports {t}" for m, t, line, _ in _edges()
           if any(t == e or t.startswith(e + ".") for e in ENTRY_POINTS)
           and not any(m == e or m.startswith(e + ".") for e in ENTRY_POINTS)
           and m not in ("autopar", "autopar.__main__", "autopar.verify_worker")]
    assert not bad, "\n".join(bad)


READ_ONLY = ("autopar.runtime", "autopar.viz")       # they read plans, never the solver


def test_the_runtime_and_the_viewer_read_only_the_plan():
    bad = [f"{m}:{line} imports {t}" for m, t, line, _ in _edges()
           if m.startswith(READ_ONLY) and (t == "autopar.solver" or t.startswith("autopar.solver."))]
    assert not bad, ("the runtime and the viewer read the plan (autopar.plan, autopar.options) "
                     "and its prices (autopar.pricing), not the solver:\n" + "\n".join(bad))


def test_the_read_only_rule_can_fail(tmp_path, monkeypatch):
    """A runtime module that imported the solver would be named."""
    fake = tmp_path / "fake.py"
    fake.write_text("from autopar.solver.driver import solve\n")
    monkeypatch.setitem(MODULES, "autopar.runtime.fake", fake)
    with pytest.raises(AssertionError, match=r"autopar.runtime.fake:1 imports autopar.solver.driver"):
        test_the_runtime_and_the_viewer_read_only_the_plan()


def test_no_import_circles():
    g = nx.DiGraph()
    for m, t, _, _ in _edges():
        if t in MODULES and t != m and not m.startswith(t + "."):   # a package's own __init__
            g.add_edge(m, t)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c + [c[0]]) for c in cycles[:10])


def test_imports_sit_at_the_top():
    lazy = []
    for mod, path in MODULES.items():
        for target, line, nested in _imports(path):
            if nested and not target.startswith(LAZY_OK):
                lazy.append(f"{path.relative_to(ROOT)}:{line} imports {target} inside a function")
    assert not lazy, f"{len(lazy)} imports inside functions:\n" + "\n".join(lazy)


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS])
def test_layer_table_names_real_modules(layer):
    prefixes = dict(LAYERS)[layer]
    for p in prefixes:
        assert any(m == p or m.startswith(p + ".") for m in MODULES), f"{p} names no module"
