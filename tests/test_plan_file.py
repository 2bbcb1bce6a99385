"""The plan file, version 3: one mesh with every axis, the pipeline an optional part of the
one plan, the options typed (``Plan.options``); version 1 and 2 files still load."""
from __future__ import annotations

import json

import pytest

import autopar
from autopar.placement import parse_placements
from autopar.options import Options
from autopar.plan import PLAN_VERSION, Pipeline, Plan, PlanError
from examples.models import EXAMPLES


@pytest.fixture(scope="module")
def plans():
    ex = EXAMPLES["mlp"](batch=8)
    flat = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:2", data=2)
    piped = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:2",
                         pipeline=2, schedule="gpipe", micro_batch_size=2)
    return flat, piped


def _as_v2(d: dict) -> dict:
    """What autopar wrote before version 3: the options named "pins"."""
    d = dict(d)
    d["pins"] = d.pop("options")
    d["version"] = 2
    return d


def _as_v1(d: dict) -> dict:
    """What autopar wrote before version 2: the pipeline's fields at the top level."""
    d = _as_v2(d)
    pipe = d.pop("pipeline") or {"stages": 1, "virtual_stages": 1, "n_microbatches": 1,
                                  "schedule": "", "stage_cuts": []}
    d.update(version=1, pipeline_stages=pipe["stages"], virtual_stages=pipe["virtual_stages"],
             n_microbatches=pipe["n_microbatches"], schedule=pipe["schedule"],
             stage_cuts=pipe["stage_cuts"])
    return d


def test_the_pipeline_is_one_part_of_the_plan(plans):
    flat, piped = plans
    assert flat.version == PLAN_VERSION == 3
    assert isinstance(flat.options, Options) and flat.options.data == 2 and flat.pins == {"data": 2}
    assert piped.options.pipeline == 2 and piped.options.schedule == "gpipe"
    assert flat.pipeline is None and flat.pipeline_stages == 1 and flat.stage_cuts == ()
    assert flat.stage_mesh_shape == tuple(flat.mesh_shape)
    assert isinstance(piped.pipeline, Pipeline)
    assert piped.mesh_axes[0] == "pipeline" and piped.mesh_shape[0] == piped.pipeline.stages == 2
    assert piped.pipeline.n_microbatches == 4 and piped.pipeline.schedule == "gpipe"
    assert piped.stage_mesh_shape == tuple(piped.mesh_shape[1:])
    # every node's placements cover every mesh axis, the pipeline's too
    for entry in piped.nodes.values():
        for s in entry.inputs + entry.outputs:
            assert len(parse_placements(s)) == len(piped.mesh_shape)


def test_json_round_trip(plans):
    for p in plans:
        d = json.loads(p.to_json())
        assert d["version"] == 3 and ("pipeline" in d) and "pins" not in d
        assert d["options"] == p.options.pinned()
        assert Plan.from_dict(d) == p


def test_version_1_and_2_files_load(plans, tmp_path):
    for p in plans:
        for old in (_as_v1, _as_v2):
            path = tmp_path / "old.json"
            path.write_text(json.dumps(old(p.to_dict())))
            assert Plan.load(path) == p


def test_an_option_the_solver_cannot_honour_names_the_field(plans):
    d = plans[0].to_dict()
    d["options"]["zero"] = 5
    with pytest.raises(PlanError, match=r"plan field options: zero=5: ZeRO stages"):
        Plan.from_dict(d)
    d["options"] = {"zero": 1, "dta": 2}
    with pytest.raises(PlanError, match=r"plan field options: unknown pin\(s\) \['dta'\]"):
        Plan.from_dict(d)


def test_unknown_version_names_the_fix(plans):
    d = plans[0].to_dict()
    d["version"] = 7
    with pytest.raises(PlanError, match=r"plan field version: 7 is not supported.*plan again"):
        Plan.from_dict(d)


def test_pipeline_part_must_match_the_mesh(plans):
    d = plans[1].to_dict()
    d["pipeline"]["stages"] = 4
    with pytest.raises(PlanError, match=r"plan field pipeline.stages: 4 .*leading mesh axis 'pipeline'"):
        Plan.from_dict(d)
    d = plans[1].to_dict()
    d["pipeline"]["n_microbatches"] = 0
    with pytest.raises(PlanError, match=r"plan field pipeline.n_microbatches: 0 is below the minimum 1"):
        Plan.from_dict(d)
