"""Figures measured on this machine, measured once per machine and kept on disk.

The ``cpu:`` clusters price against this machine's CPU core and TCP loopback link
(``cpu.py``). Measured afresh in every process, two plannings of one model priced with
two slightly different sets of constants, and a difference of a few percent flipped
choices (two runs of ``autopar plan examples.models:gpt_factory --cluster cpu:4`` gave
two plan digests; issue 40). The rule, so the same inputs give the same plan:

1. A figure set (``name``: ``"cpu-core"``, ``"loopback"``) is measured by the first process
   that needs it on this machine and written to
   ``<cache_dir>/machine/<name>-<machine key>.json`` (``cache_dir``: ``$AUTOPAR_CACHE`` or
   ``~/.cache/autopar``, as the profiler's table). Every later process, idle or loaded,
   reads that file instead of measuring. The first writer wins: a process that measured
   at the same time as another writes only if no file is there yet (an exclusive
   ``os.link``), then reads back the file that won, so two processes never plan with
   different figures even when they raced.
2. The machine key is the host name, the CPU model (``/proc/cpuinfo``), the number of
   logical CPUs and torch's version: a new torch or other hardware measures again.
3. Every figure is rounded to :data:`SIGNIFICANT` significant digits before it is kept:
   a cache measured again (deleted, another day) lands on the same constants unless the
   measurement moved across a rounding boundary. The rounding costs at most 5% of a
   figure; the spread between measurements on a shared machine is larger.

To measure again (after a hardware change the key does not see, or a first measurement
taken under heavy load), delete the file (:func:`cache_path` names it).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
from pathlib import Path
from typing import Callable

import torch

FORMAT = 1
SIGNIFICANT = 2
"""Significant digits kept of every measured figure (rule 3 of the module doc)."""


SWITCH_VALUES = ("", "0", "false", "off", "no", "1", "true", "on", "yes")
"""Values of ``$AUTOPAR_CACHE`` that switch the capture cache (``autopar.capture.cache``)
on or off rather than name a folder."""


def default_cache_dir() -> Path:
    """``$AUTOPAR_CACHE`` when it names a folder, else ``~/.cache/autopar`` (``0``, ``off``
    and the like switch the capture cache; they are not folders)."""
    env = os.environ.get("AUTOPAR_CACHE", "")
    return Path(env) if env.strip().lower() not in SWITCH_VALUES else Path.home() / ".cache" / "autopar"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> str:
    """``<host>-<10 hex digits>``: the host name, and a hash of the CPU model, the number of
    logical CPUs and torch's version (rule 2 of the module doc)."""
    what = f"{_cpu_model()}|{os.cpu_count()}|{torch.__version__}"
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in platform.node()) or "host"
    return f"{host}-{hashlib.sha256(what.encode()).hexdigest()[:10]}"


def cache_path(name: str) -> Path:
    """Where figure set ``name`` of this machine is kept."""
    return default_cache_dir() / "machine" / f"{name}-{machine_key()}.json"


def significant(x: float, digits: int = SIGNIFICANT) -> float:
    """``x`` rounded to ``digits`` significant digits (0, inf and nan unchanged)."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - math.floor(math.log10(abs(x))))


def rounded(figures):
    """``figures`` (numbers, nested in dicts and lists) with every float rounded to
    :data:`SIGNIFICANT` digits."""
    if isinstance(figures, dict):
        return {k: rounded(v) for k, v in figures.items()}
    if isinstance(figures, (list, tuple)):
        return [rounded(v) for v in figures]
    if isinstance(figures, float):
        return significant(figures)
    return figures


def _read(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or d.get("format") != FORMAT or not isinstance(d.get("figures"), dict):
        return None
    return d["figures"]


def _write_first(path: Path, figures: dict, name: str) -> None:
    """Write ``figures`` to ``path`` unless a file is there already (first writer wins)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    except OSError:             # an unwritable cache: this process keeps its own figures
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "name": name, "machine": machine_key(),
                       "torch": torch.__version__, "figures": figures}, f, indent=1)
        try:
            os.link(tmp, path)  # atomic, and fails if another process wrote first
        except FileExistsError:
            pass
        except OSError:         # a file system without hard links: replace if still absent
            if not path.exists():
                os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def measured_once(name: str, measure: Callable[[], dict]) -> dict:
    """Figure set ``name`` of this machine: read from :func:`cache_path`, else ``measure()``
    rounded (:func:`rounded`), kept there, and read back (module doc)."""
    path = cache_path(name)
    got = _read(path)
    if got is not None:
        return got
    figures = rounded(measure())
    _write_first(path, figures, name)
    return _read(path) or figures
