"""A price table prices each option's seconds and bytes on first read
(``pricing.prices.PriceTable.option``): the compute floor reads no bytes, the memory floor
no seconds, and what the table gives is what the cost model gives (a Llama on a data x
tensor mesh of H100s in bf16)."""
from __future__ import annotations

import pytest

from autopar.capture import capture
from autopar.cost_models.hardware import parse_cluster
from autopar.mesh_roles import MeshRoles
from autopar.options import Options
from autopar.pricing.costing import CostModel
from autopar.pricing.prices import PriceTable, compute_floor, memory_floor, price_table
from autopar.pricing.problem import build_problem
from examples.models import EXAMPLES


@pytest.fixture(scope="module")
def problem():
    ex = EXAMPLES["llama"]()
    cap = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    return build_problem(cap, (2, 2), MeshRoles(data=0, tensor=1))


def _cost(problem) -> CostModel:
    return CostModel.for_pins(parse_cluster("1x4xH100"), problem.mesh_shape,
                              Options.from_pins({"precision": "bf16"}), data_axis=0)


def test_each_floor_prices_only_what_it_reads(problem):
    cost = _cost(problem)
    floor = compute_floor(problem, cost)
    pt = price_table(problem, cost)
    options = sum(len(v.options) for v in problem.vars.values())
    assert len(pt._base_times) == options and not pt._base_memory
    memory_floor(problem, cost)
    assert price_table(problem, cost) is pt           # the program reads the same table
    assert len(pt._base_memory) == options
    assert floor > 0


def test_the_table_gives_the_cost_models_prices(problem):
    cost = _cost(problem)
    pt = PriceTable(problem, cost)
    k = problem.optimizer_states
    for name, v in problem.vars.items():
        for i, combo in enumerate(v.options):
            o = pt.option(name, i)
            assert (o.forward_s, o.backward_s) == cost.base_time(v, combo, k)
            assert o.memory == cost.base_memory(v, combo, k)
            assert pt.time(name, i) == cost.with_recompute(v, cost.base_time(v, combo, k),
                                                           cost.base_memory(v, combo, k))
            assert pt.memory(name, i) == {key: len(v.members) * b for key, b in
                                          cost.node_memory(v, combo, k).items()}
