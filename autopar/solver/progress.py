"""Where a long planning says how far it got: the free search tells the reporter that
:func:`reporting` opened each stage it begins and ends, with the best predicted step so far.

The ``autopar plan`` command opens one that updates its progress line (one line, rewritten
in place by rich); ``--quiet`` opens one that says nothing. With none open (the library's
``autopar.plan``), the free search prints a line on stderr per stage that ends after
``free_search.PROGRESS_AFTER_S`` seconds of planning, as before.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Optional

Reporter = Callable[[str, Optional[float], Optional[float]], None]
"""``reporter(stage, seconds, best_s)``: ``seconds`` is None when the stage begins, its
wall seconds when it ends; ``best_s`` the best predicted step so far (None before any)."""

_REPORTER: contextvars.ContextVar[Reporter | None] = contextvars.ContextVar(
    "autopar_progress", default=None)


@contextlib.contextmanager
def reporting(reporter: Reporter):
    """While open, the search's stages go to ``reporter`` (in this thread and context)."""
    token = _REPORTER.set(reporter)
    try:
        yield reporter
    finally:
        _REPORTER.reset(token)


def reporter() -> Reporter | None:
    """The open reporter, or None."""
    return _REPORTER.get()


def quiet(stage: str, seconds: float | None, best_s: float | None) -> None:
    """The reporter that says nothing (``autopar plan --quiet``)."""
