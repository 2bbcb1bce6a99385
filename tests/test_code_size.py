"""Two size rules of issue 41 (item 4), read from the source with ``ast`` so they cannot
regress:

- no function of ``autopar/solver`` or ``autopar/pricing`` takes more than
  :data:`MAX_PARAMETERS` parameters (positional, keyword-only, and one each for ``*args``
  and ``**kwargs``; ``self`` and ``cls`` not counted): what travels together is one value
  (``SearchSpec``, ``Settings``, ``MeshAsk``, ``StepView``, ``MeshRoles``, ``Options``);
- no class of the package (``autopar``, ``cost_models``, ``passes``) is longer than
  :data:`MAX_CLASS_LINES` lines, except those in :data:`STILL_OVER`, each at most its
  recorded length (it may only shrink; once within the rule it leaves the table).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_PARAMETERS = 8
MAX_CLASS_LINES = 350
PARAMETER_DIRS = ("autopar/solver", "autopar/pricing")
CLASS_DIRS = ("autopar", "cost_models", "passes")

STILL_OVER: dict[str, int] = {}
"""Classes over :data:`MAX_CLASS_LINES` when the rule came in, with their lines then."""


def n_parameters(f: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Parameters of ``f``: positional-only, positional and keyword-only (not ``self`` or
    ``cls``), plus one each for ``*args`` and ``**kwargs``."""
    a = f.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    return (sum(1 for n in names if n not in ("self", "cls"))
            + (a.vararg is not None) + (a.kwarg is not None))


def too_many_parameters(source: str, where: str) -> list[str]:
    """``where:line name (n)`` of each function in ``source`` over :data:`MAX_PARAMETERS`."""
    return [f"{where}:{node.lineno} {node.name} ({n_parameters(node)})"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n_parameters(node) > MAX_PARAMETERS]


def class_lines(source: str, where: str) -> dict[str, int]:
    """``where:Name`` -> lines of every class in ``source`` (decorators not counted)."""
    return {f"{where}:{node.name}": node.end_lineno - node.lineno + 1
            for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)}


def _sources(dirs):
    for d in dirs:
        for path in sorted((ROOT / d).rglob("*.py")):
            if not any(p.is_symlink() for p in [path, *path.parents] if ROOT in p.parents):
                yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_solver_and_pricing_functions_take_at_most_eight_parameters():
    over = [line for where, src in _sources(PARAMETER_DIRS) for line in too_many_parameters(src, where)]
    assert not over, (f"functions over {MAX_PARAMETERS} parameters (pass SearchSpec, Settings, "
                      "MeshAsk, StepView, MeshRoles or Options instead of their fields):\n"
                      + "\n".join(over))


def test_no_class_is_over_the_line_limit():
    lines = {k: n for where, src in _sources(CLASS_DIRS) for k, n in class_lines(src, where).items()}
    over = [f"{k}: {n} lines" for k, n in lines.items()
            if n > MAX_CLASS_LINES and n > STILL_OVER.get(k, 0)]
    assert not over, (f"classes over {MAX_CLASS_LINES} lines (split them by concern, as "
                      "pricing.costing.CostModel is into CommCosts and MemoryCosts):\n" + "\n".join(over))
    stale = [k for k in STILL_OVER if lines.get(k, 0) <= MAX_CLASS_LINES]
    assert not stale, f"within {MAX_CLASS_LINES} lines now (or gone): drop from STILL_OVER: {stale}"


def test_the_rules_can_fail():
    """A function of nine parameters and a class one line over the limit are named; eight
    parameters (``self`` aside) and ``*args`` / ``**kwargs`` count as the rule says."""
    nine = "def f(a, b, c, d, e, f, g, h, i):\n    pass\n"
    assert too_many_parameters(nine, "x.py") == ["x.py:1 f (9)"]
    eight = "class C:\n    def m(self, a, b, c, d, e, f, *args, **kw):\n        pass\n"
    assert too_many_parameters(eight, "x.py") == []
    assert too_many_parameters(eight.replace("*args", "g, *args"), "x.py") == ["x.py:2 m (9)"]
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_CLASS_LINES))
    assert class_lines("class Big:\n" + body, "x.py") == {"x.py:Big": MAX_CLASS_LINES + 1}
