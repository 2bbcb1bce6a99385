"""Elastic re-planning keeps every mesh pin but ``data`` (``autopar.elastic.elastic_pins``).

The bug this guards: ``context=`` was missing from the pins an elastic job keeps, so
``context=2`` on 4 ranks gave ``data=4``, and the mesh data 4 x context 2 needs 8 ranks.
Each case checks the pins the world gets and that the mesh they pin holds exactly the
world (``autopar.solver.meshes.mesh_candidates``, the mesh the solver then uses)."""
from __future__ import annotations

import math
from dataclasses import fields

import pytest

from autopar.elastic import MODEL_AXES, elastic_pins
from autopar.errors import ArgumentError
from autopar.options import MESH_AXIS_PINS, Options
from autopar.solver.meshes import mesh_candidates

BATCH = 8


def _replan(world: int, **pins) -> Options:
    opts, info = elastic_pins(Options.from_pins(pins), world, BATCH)
    assert info.data == opts.data and info.world == world
    return opts


def _mesh_devices(world: int, opts: Options) -> int:
    """Devices of the one mesh the pins give (pipeline and branch are outer axes)."""
    inner = dict(opts)
    outer = (inner.pop("pipeline", None) or 1) * (inner.pop("branch", None) or 1)
    (shape, _, _), = mesh_candidates(world // outer, Options.from_pins(inner), None)
    return math.prod(shape) * outer


def test_context_pin_is_kept_and_data_takes_the_rest():
    opts = _replan(4, context=2)
    assert (opts.data, opts.context) == (2, 2)
    assert _mesh_devices(4, opts) == 4
    opts = _replan(8, context=2)
    assert (opts.data, opts.context) == (4, 2)
    with pytest.raises(ArgumentError, match="context=2 need a multiple of 2 ranks, but this job has 3"):
        _replan(3, context=2)


@pytest.mark.parametrize("pin", ["expert", "tensor", "pipeline"])
def test_other_model_axis_pins_are_kept(pin):
    opts = _replan(4, **{pin: 2})
    assert opts.get(pin) == 2 and opts.data == 2
    assert _mesh_devices(4, opts) == 4


def test_every_mesh_axis_but_data_is_kept():
    names = {f.name for f in fields(Options)}
    assert set(MESH_AXIS_PINS) <= names, set(MESH_AXIS_PINS) - names
    assert set(MODEL_AXES) == set(MESH_AXIS_PINS) - {"data"}


def _info(world: int, batch: int = BATCH, **pins):
    return elastic_pins(Options.from_pins(pins), world, batch)


def test_a_pipeline_keeps_each_ranks_micro_batch():
    """A pipeline's ``micro_batch_size`` is the rows of a micro-batch of the global batch,
    split over the data ranks: on half the data ranks it halves, and the pipeline runs
    twice the micro-batches, each rank's as large as before."""
    opts, info = _info(4, pipeline=2, data=2, micro_batch_size=2)
    assert (opts.data, opts.micro_batch_size, info.accumulate, info.rows_per_rank) == (2, 2, 4, 1)
    opts, info = _info(2, pipeline=2, data=2, micro_batch_size=2)
    assert (opts.data, opts.micro_batch_size, info.accumulate, info.rows_per_rank) == (1, 1, 8, 1)
    assert opts.accumulate is None
    opts, _ = _info(2, pipeline=2, data=2)          # no micro_batch_size: the solver's choice
    assert (opts.data, opts.micro_batch_size) == (1, None)
    with pytest.raises(ArgumentError, match=r"data=2 x micro_batch_size=1 does not split"):
        _info(4, pipeline=2, data=2, micro_batch_size=1)


def test_micro_batch_size_without_a_pipeline_becomes_accumulate():
    opts, info = _info(1, data=2, micro_batch_size=4)     # 2 rows a rank a micro-batch
    assert (opts.data, opts.accumulate, opts.micro_batch_size, info.rows_per_rank) == (1, 4, None, 2)


def test_the_expert_axis_splits_the_batch_too():
    """``expert=`` ranks split the batch as data ranks do (``autopar.runtime.data``)."""
    opts, info = _info(4, expert=2, data=2)
    assert (opts.data, opts.accumulate, info.rows_per_rank) == (2, None, 2)
    opts, info = _info(2, expert=2, data=2)
    assert (opts.data, opts.accumulate, info.rows_per_rank) == (1, 2, 2)
    with pytest.raises(ArgumentError, match=r"6 rows does not split over the 2 data ranks x "
                                            r"expert=2 of this 4-rank job.*\(2, 6\b"):
        _info(4, 6, expert=2)
