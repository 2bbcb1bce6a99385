"""Shared fixtures: each example model is built and captured once per test session."""
from __future__ import annotations

import functools

import pytest

from autopar.capture import capture
from examples.models import EXAMPLES


@functools.lru_cache(maxsize=None)
def example_and_capture(name: str):
    ex = EXAMPLES[name]()
    return ex, capture(ex.model, ex.inputs, ex.loss_fn, ex.target)


@pytest.fixture
def captured():
    return example_and_capture
