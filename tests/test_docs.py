"""The documentation: the mkdocs site builds strictly, and its Python runs.

- ``mkdocs build --strict`` (``mkdocs.yml``, pages in ``docs/``) into a temporary
  directory: a broken link, a missing anchor, a page left out of the nav or a bad
  configuration fails it. Skipped only where mkdocs is not installed (the dev extra brings
  it).
- Every ```` ```python ```` block of ``docs/*.md`` and ``README.md`` runs, each on its own
  (a fresh namespace, a temporary working directory), in this process with a world of 1
  (``RANK=0 WORLD_SIZE=1``: ``autopar.parallelize`` makes the gloo group of one rank), or
  is marked not runnable by the line just before it::

      <!-- not run: the reason, e.g. needs torchrun with 4 ranks -->

  A marker without a reason, or one that is not followed by a Python block, fails.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist

from launch import free_port

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)")
MARKER = re.compile(r"^<!--\s*not run:(.*?)-->\s*$")
PYTHON = {"python", "py", "python3", "pycon"}


@dataclass(frozen=True)
class Block:
    where: str              # docs/page.md:LINE of the opening fence
    lang: str
    source: str
    not_run: str | None     # the marker's reason; None: runs
    marker_line: str | None  # the line before the fence when it looks like a marker


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, with the line before each."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2).lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            j += 1
        body = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:j])
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        before = lines[k].strip() if k >= 0 else ""
        marker = before if before.startswith("<!--") and "not run" in before else None
        reason = None
        if marker is not None:
            mm = MARKER.match(marker)
            reason = mm.group(1).strip() if mm else ""
        out.append(Block(f"{path.relative_to(ROOT)}:{i + 1}", lang, body + "\n", reason, marker))
        i = j + 1
    return out


ALL = [b for p in PAGES for b in blocks(p)]
PY = [b for b in ALL if b.lang in PYTHON]
RUN: dict[str, list[Block]] = {}
for _b in PY:                       # the same block on two pages runs once
    if _b.not_run is None:
        RUN.setdefault(_b.source, []).append(_b)


def test_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[dev]' brings mkdocs and "
                    "mkdocs-material)")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                        str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    for page in (ROOT / "docs").glob("*.md"):
        name = "index.html" if page.stem == "index" else f"{page.stem}/index.html"
        assert (tmp_path / "site" / name).is_file(), f"{page.name} was not built"


def test_every_python_block_runs_or_says_why_not():
    assert PY, "no Python block found: the extraction is broken"
    assert any(b.where.startswith("README.md") and b.not_run is None for b in PY), \
        "README.md's quick start is not among the blocks that run"
    bad = [f"{b.where}: {b.marker_line!r}" for b in PY if b.not_run == ""]
    assert not bad, ("a 'not run' marker needs its reason, as <!-- not run: needs torchrun "
                     "with 4 ranks -->: " + "; ".join(bad))
    stray = [b.where for b in ALL if b.marker_line is not None and b.lang not in PYTHON]
    assert not stray, f"'not run' markers before blocks that are not Python: {stray}"


def test_no_marker_is_left_without_its_block():
    for page in PAGES:
        lines = page.read_text().splitlines()
        fenced = False                  # inside a code block: text, not a marker
        for n, line in enumerate(lines):
            if line.strip().startswith("```"):
                fenced = not fenced
            if not fenced and MARKER.match(line.strip()):
                nxt = next((ln for ln in lines[n + 1:] if ln.strip()), "")
                assert FENCE.match(nxt) and FENCE.match(nxt).group(2).lower() in PYTHON, \
                    f"{page.relative_to(ROOT)}:{n + 1}: a 'not run' marker must be the line " \
                    f"just before a ```python block"


@pytest.fixture
def world_of_one(tmp_path, monkeypatch):
    """One rank's torchrun environment, in a temporary working directory; the process
    group a block makes is destroyed after it."""
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AUTOPAR_CHECK", raising=False)
    monkeypatch.chdir(tmp_path)
    assert not dist.is_initialized(), "a process group was left by an earlier test"
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("same", list(RUN.values()), ids=lambda same: "+".join(b.where for b in same))
def test_python_block_runs(same, world_of_one):
    code = compile(same[0].source, same[0].where, "exec")
    exec(code, {"__name__": "__docs__"})
