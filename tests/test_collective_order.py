"""Proven before it runs (``autopar.runtime.collective_order``): every rank of each process
group issues the same collectives in the same order, or the program is refused with an
error naming the first collective where two ranks differ, never left to hang.

In process: the collectives read from Inductor's generated code (lines as torch 2.13 writes
them: a bucketed all-gather into a buffer, an in-place all-reduce, a reduce-scatter of a
reinterpreted buffer) and from a rewritten fx graph; the comparison per group. On 2 gloo
ranks (one torchrun launch): a compiled and an eager program whose ranks all-reduce and
all-gather in opposite orders are refused on both ranks; in one order they run and sum.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import pytest

from autopar.ops import collectives
from autopar.runtime.collective_order import (
    Collective, first_difference, graph_collectives, inductor_collectives,
)
from launch import case_result, torchrun_cases

pytestmark = pytest.mark.timeout(900)     # a fresh machine's first Inductor compile: minutes

GROUPS = {"1": ("data", (0, 1))}

INDUCTOR_CODE = """
def call(args):
    arg3_1, = args
    assert_size_stride(arg3_1, (64, 4), (4, 1))
    with torch.cpu._DeviceGuard(0):
        buf5 = empty_strided_cpu((82080, ), (1, ), torch.float32)
        torch.ops._c10d_functional.all_gather_into_tensor_out.default(reinterpret_tensor(buf5, (41040, ), (1, ), 0), 2, '1', out=buf5)
        torch.ops._c10d_functional.wait_tensor.default(buf5)
        buf67 = empty_strided_cpu((2, 32, 64), (2048, 64, 1), torch.float32)
        torch.ops._c10d_functional.all_reduce_.default(buf67, 'sum', '1')
        buf86 = torch.ops._c10d_functional.reduce_scatter_tensor.default(reinterpret_tensor(buf85, (16384, ), (1, ), 0), 'sum', 2, '1')
        buf90 = torch.ops._c10d_functional.all_gather_into_tensor.default(arg3_1, 2, '1')
"""


def test_inductor_code_lists_its_collectives_in_order_with_sizes():
    got = inductor_collectives(INDUCTOR_CODE, GROUPS)
    assert [(c.kind, c.group, c.axis, c.numel) for c in got] == [
        ("all_gather", "1", "data", 41040),         # the shard sent, not the gathered buffer
        ("all_reduce", "1", "data", 2 * 32 * 64),   # its buffer's allocation
        ("reduce_scatter", "1", "data", 16384),
        ("all_gather", "1", "data", 64 * 4),        # a graph input: its asserted shape
    ]
    assert all(c.ranks == (0, 1) for c in got)


def test_a_rewritten_graph_lists_its_collectives():
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 8)
    y = g.call_function(collectives.all_gather, (x,), {"axis": 0, "dim": 0})
    z = g.call_function(collectives.scatter, (y,), {"axis": 0, "dim": 1})   # no communication
    g.output(g.call_function(collectives.all_reduce, (z,), {"axis": 0}))
    got = graph_collectives(fx.GraphModule(torch.nn.Module(), g), [("1", "data", (0, 1))])
    assert [(c.kind, c.of, c.numel) for c in got] == [("all_gather", "x", 32),
                                                      ("all_reduce", "scatter", None)]


def _c(kind, numel, group="1", ranks=(0, 1)):
    return Collective(kind, group, "data", ranks, numel)


def test_the_same_order_passes_and_another_is_named():
    same = [_c("all_gather", 82080), _c("reduce_scatter", 24576)]
    assert first_difference({0: ("train", same), 1: ("train", list(same))}, "FIX") is None
    swapped = {0: ("train", same), 1: ("train", same[::-1])}
    msg = first_difference(swapped, "FIX")
    assert msg is not None
    assert "collective #0 is, on rank 0, all_gather (82,080 elements)" in msg, msg
    assert "on rank 1, reduce_scatter (24,576 elements)" in msg, msg
    assert msg.endswith("FIX"), msg


def test_a_missing_collective_and_another_size_are_named():
    a = [_c("all_reduce", 10), _c("all_gather", 4)]
    msg = first_difference({0: ("p", a), 1: ("p", a[:1])}, "FIX")
    assert "#1 is, on rank 0, all_gather (4 elements)" in msg and "on rank 1, nothing" in msg, msg
    msg = first_difference({0: ("p", a), 1: ("p", [a[0], _c("all_gather", 5)])}, "FIX")
    assert "#1" in msg and "(5 elements)" in msg, msg


def test_groups_are_compared_apart():
    """Ranks 0, 1 and 2, 3 form groups "a" and "b" of one axis, "x" and "y" of another:
    each rank lists its own groups; interleaved differently across groups is not a
    difference within one group, but a group whose two ranks disagree is."""
    def seq(first, second):
        return [_c("all_reduce", 8, first[0], first[1]), _c("all_gather", 4, second[0], second[1])]
    a, b, x, y = ("a", (0, 1)), ("b", (2, 3)), ("x", (0, 2)), ("y", (1, 3))
    ok = {0: ("p", seq(a, x)), 1: ("p", seq(a, y)), 2: ("p", seq(b, x)), 3: ("p", seq(b, y))}
    assert first_difference(ok, "FIX") is None
    bad = dict(ok)
    bad[3] = ("p", [_c("all_reduce", 9, *b)] + seq(b, y)[1:])
    msg = first_difference(bad, "FIX")
    assert "on rank 2, all_reduce (8 elements)" in msg and "on rank 3, all_reduce (9 elements)" in msg, msg


def test_different_programs_at_the_check_are_named():
    msg = first_difference({0: ("train forward", []), 1: ("train backward", [])}, "FIX")
    assert "rank 0: train forward, rank 1: train backward" in msg, msg


CASES = [
    {"id": "compiled-differ", "mode": "compiled", "differ": True},
    {"id": "compiled-same", "mode": "compiled", "differ": False},
    {"id": "eager-differ", "mode": "eager", "differ": True},
    {"id": "eager-same", "mode": "eager", "differ": False},
    {"id": "absent", "mode": "absent", "differ": False},
]


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    return torchrun_cases("order_worker.py", 2, CASES, tmp_path_factory.mktemp("order") / "r.json",
                          timeout=850, case_timeout=400)


@pytest.mark.parametrize("mode", ["compiled", "eager"])
def test_ranks_in_different_orders_are_refused_before_running(gloo_results, mode):
    r = case_result(gloo_results, f"{mode}-differ")
    msg = r["refused"]
    assert msg is not None and r["refused_on"] == [True, True], r      # on both ranks
    assert "collective #0 is, on rank 0, all_reduce" in msg and "on rank 1, all_gather" in msg, msg
    assert "(3 elements)" in msg and "(5 elements)" in msg, msg
    assert ("without compile=True" in msg) == (mode == "compiled"), msg


def test_a_rank_that_never_comes_is_named_not_waited_for(gloo_results):
    """The lists meet in the job's store: a rank that does not reach the check (failed,
    or still compiling) ends the others' wait at the timeout with its rank named."""
    msg = case_result(gloo_results, "absent")["refused"]
    assert msg is not None and "rank(s) [1] did not reach the collective-order check within 2 s" in msg, msg


@pytest.mark.parametrize("mode", ["compiled", "eager"])
def test_ranks_in_one_order_run(gloo_results, mode):
    r = case_result(gloo_results, f"{mode}-same")
    assert r["refused"] is None and r["refused_on"] == [False, False], r
    # rank r holds a = r + 1 (3 elements), b = 10 (r + 1) (5 elements)
    assert r["sums"] == [[3.0] * 3, [10.0] * 5 + [20.0] * 5], r
    want = (["the train program's forward", "the train program's backward"] if mode == "compiled"
            else ["the train program"])
    assert r["checked"] == want, r
