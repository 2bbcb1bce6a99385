"""Shared fixtures: each example model is built and captured once per test session."""
from __future__ import annotations

import functools
import os

import pytest
from hypothesis import settings

# CI replays the same examples every run (a failure there is reproducible); on a developer's
# machine hypothesis draws new ones each run and keeps finding what CI has not seen.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

from autopar.capture import capture
from examples.models import EXAMPLES


@functools.lru_cache(maxsize=None)
def example_and_capture(name: str):
    ex = EXAMPLES[name]()
    return ex, capture(ex.model, ex.inputs, ex.loss_fn, ex.target)


@pytest.fixture
def captured():
    return example_and_capture
