"""An op's options filtered axis by axis first (``pricing.problem._axis_choices``) are the
options the roles' filters leave of every option of its rule (``_filtered_choices``): the
same list in the same order, node by node, on meshes where each role's axis narrows them
(data x tensor, data x expert x tensor, expert x tensor under the all-to-all dispatch, data x
context x tensor, data alone), for a GPT, a Llama and a Mixtral (an expert axis without
experts splits samples); and the shortcut is taken for most nodes (else it saves
nothing)."""
from __future__ import annotations

import functools

import pytest

from autopar.capture import capture
from autopar.mesh_roles import MeshRoles
from autopar.pricing import problem as pb
from examples.models import EXAMPLES

MESHES = {
    "data-tensor": ((2, 2), MeshRoles(data=0, tensor=1)),
    "data-expert-tensor": ((2, 2, 2), MeshRoles(data=0, expert=1, tensor=2)),
    "expert-tensor-all-to-all": ((2, 2), MeshRoles(expert=0, tensor=1, dispatch="all-to-all")),
    "data-context-tensor": ((2, 2, 2), MeshRoles(data=0, context=1, tensor=2)),
    "data-only": ((4,), MeshRoles(data=0)),
}


@functools.cache
def _captured(name: str):
    if name == "mixtral":
        pytest.importorskip("transformers", reason="pip install -e '.[dev]' installs transformers")
        from examples import zoo
        ex = zoo.HF_BUILDERS["mixtral"](batch=8)
    else:
        ex = EXAMPLES[name]()
    return capture(ex.model, ex.inputs, ex.loss_fn, ex.target)


def _options(cap, shape, roles, axes_first: bool, monkeypatch):
    monkeypatch.setattr(pb, "FILTER_AXES_FIRST", axes_first)
    try:
        problem = pb.build_problem(cap, shape, roles)
    except ValueError as e:        # PinError: a role the model cannot take, both ways alike
        return type(e), str(e)
    return {name: v.options for name, v in problem.vars.items()}


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("model", ["gpt", "llama", "mixtral"])
def test_axis_first_gives_the_filtered_options(model, mesh, monkeypatch):
    cap = _captured(model)
    shape, roles = MESHES[mesh]
    taken = []
    axis_choices = pb._axis_choices

    def counted(*a, **k):
        got = axis_choices(*a, **k)
        taken.append(bool(got))
        return got

    monkeypatch.setattr(pb, "_axis_choices", counted)
    fast = _options(cap, shape, roles, True, monkeypatch)
    slow = _options(cap, shape, roles, False, monkeypatch)
    assert fast == slow
    if isinstance(fast, dict):
        assert any(len(o) > 1 for o in fast.values())      # choices to make, not all pinned
        assert sum(taken) > 0.5 * len(taken), f"the shortcut answered {sum(taken)} of {len(taken)}"
