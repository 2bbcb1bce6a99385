"""ZeRO-3's fp8 all-gather (``passes/fp8_gathers.py``, ``Options.fp8_gathers``): the pins,
the price (1 byte an element instead of bf16's 2, and the amax's all-gather), and on thread
ranks the run with the weights gathered in fp8 bit-equal to the run gathering them in bf16,
data 2 x tensor 2 (the amax reduced over the tensor axis too) and data 2 recomputed (each weight
gathered alone), with uint8 on the wire.
The distributed check against one device is ``tests/test_fp8.py``'s ``tensorwise-zero3``
case (``tests/fp8_worker.py``), which also counts the bytes its gathers sent.
"""
from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from autopar.capture import capture
from autopar.cost_models.hardware import parse_cluster
from autopar.errors import PinError
from autopar.ops.comm import ThreadComm
from autopar.options import Options
from autopar.placement import Replicate
from autopar.cost_models.fp8 import CAST_BYTES_PER_ELEMENT, CAST_KERNELS, TRANSPOSE, cast_time
from autopar.pricing.comm_costs import _local
from autopar.pricing.fp8 import gathered_in_fp8
from autopar.pricing.prices import plan_prices
from autopar.sharding.registry import input_placements
from autopar.runtime.thread_ranks import simulate
from autopar.solver.flat import plan_captured
from examples.models import EXAMPLES

FP8 = {"precision": "fp8", "fp8_layers": "all"}


def test_fp8_all_gather_pins():
    """On by default where it applies (tensorwise, ZeRO-3, eager), off when pinned off;
    pinned on where it cannot apply: an error naming the pin and the fix."""
    assert Options.from_pins(zero=3, **FP8).fp8_gathers
    assert not Options.from_pins(zero=3, fp8_all_gather=False, **FP8).fp8_gathers
    assert not Options.from_pins(zero=2, **FP8).fp8_gathers
    assert not Options.from_pins(zero=3, fp8_scaling="rowwise", **FP8).fp8_gathers
    assert not Options.from_pins(zero=3, compile=True, **FP8).fp8_gathers
    assert not Options.from_pins(zero=3, precision="bf16").fp8_gathers
    for bad in ({"precision": "bf16", "zero": 3}, {**FP8, "fp8_scaling": "rowwise"},
                {**FP8, "zero": 2}, {**FP8, "compile": True}):
        with pytest.raises(PinError, match="fp8_all_gather=True .* drop fp8_all_gather="):
            Options.from_pins(fp8_all_gather=True, **bad)
    with pytest.raises(PinError, match="fp8_all_gather='yes'"):
        Options.from_pins(fp8_all_gather="yes", **FP8)


def _gpt():
    ex = EXAMPLES["gpt"]()
    return ex, capture(ex.model, ex.inputs, ex.loss_fn, target=ex.target)


def _gather_bytes(c, cost) -> float:
    """The bytes a priced all-gather ``c`` moves: ``cost_models.comm.terms_time`` inverted
    (less the link's wait for the peers, which a lone consumer's gather pays whole)."""
    terms = cost._terms(c.kind, c.axis)
    t = c.seconds - cost.links[c.axis].skew - terms.latency_s
    return t * terms.bandwidth / terms.factor - terms.half_bytes


@pytest.fixture(scope="module")
def tables():
    """The small GPT on 2 H100s, data=2, ZeRO-3, fp8 tensorwise, every linear pinned fp8:
    fp8_all_gather -> (its plan, the plan's price table)."""
    ex, cap = _gpt()
    out = {}
    for on in (True, False):
        plan = plan_captured(cap, parse_cluster("1x2xH100"), 2,
                             pins={"data": 2, "zero": 3, "pipeline": 1, "fp8_all_gather": on, **FP8})
        out[on] = (plan, plan_prices(cap, plan))
    return out


def test_fp8_gather_priced_at_half_the_bytes(tables):
    """Each fp8 linear's weight gather (forward, and again in backward) is priced at 1 byte
    an element where bf16's moves 2, its copy-out at half, plus one all-gather of a 4-byte
    amax a rank; with ``fp8_all_gather=False`` the same edges price bf16's bytes and no
    amax gather."""
    plan, on = tables[True]
    off = tables[False][1]
    assert off.fp8_edges == frozenset()
    weights = {name for name, v in on.problem.vars.items() if v.kind == "param"
               and any(on.problem.edges[k].src == name for k in on.fp8_edges)}
    # the representatives' weights: every fp8 linear of a repeated layer's first copy
    assert len(weights) == 4 and len(on.fp8_edges) == 4, sorted(weights)
    cost = on.cost
    for k in on.fp8_edges:
        e = on.problem.edges[k]
        src = tuple(plan.nodes[e.src].output(0))
        dst, out = tuple(plan.nodes[e.dst].input(1)), tuple(plan.nodes[e.dst].output(0))
        gp = tuple(isinstance(d, Replicate) and not isinstance(o, Replicate) for d, o in zip(dst, out))
        numel = math.prod(e.meta.shape)
        by_kind = {}
        for table, nbytes in ((on, 1), (off, 2)):
            steps = table.edge(k, src, dst, gp).steps
            gathers = [c for c in steps if c.kind == "all_gather" and c.regather]
            assert len(gathers) == 1, steps
            assert _gather_bytes(gathers[0], cost) == pytest.approx(numel * nbytes, rel=1e-9)
            by_kind[nbytes] = steps
        amax = [c for c in by_kind[1] if c.kind == "all_gather" and not c.regather]
        assert len(amax) == 1 and not amax[0].backward, by_kind[1]
        assert _gather_bytes(amax[0], cost) == pytest.approx(4 * 2, rel=1e-9)
        assert not [c for c in by_kind[2] if c.kind == "all_gather" and not c.regather]
        copy8, copy16 = ([c.seconds for c in by_kind[b] if c.kind == "copy_out"] for b in (1, 2))
        assert copy8[0] == pytest.approx(copy16[0] / 2, rel=1e-12)
        # the gradient's reduce-scatter is the same
        rs8, rs16 = ([c.seconds for c in by_kind[b] if c.kind == "reduce_scatter"] for b in (1, 2))
        assert rs8 == rs16 and rs8


@pytest.mark.parametrize("pins", [{"data": 2, "tensor": 2}, {"data": 2, "recompute": "full"}],
                         ids=["buckets-2x2", "one-by-one-recomputed"])
def test_fp8_gather_equals_bf16_gather_on_thread_ranks(monkeypatch, pins):
    """ZeRO-3, fp8 tensorwise, 3 AdamW steps on thread ranks: gathering the fp8 linears'
    weights in fp8 gives bit for bit the losses, gradients and weights of gathering them in
    bf16 (the cast is elementwise with the whole weight's scale), and the fp8 run's gathers
    send uint8 where the other's sent bf16. data 2 x tensor 2: bucketed gathers
    (``ops.param_buckets``), the amax max-reduced over the tensor axis too; data 2 with
    every layer recomputed: no prefetch, each weight gathered alone
    (``ops.collectives._Fp8AllGather``), and again when its layer is recomputed."""
    ex, cap = _gpt()
    sent: dict[str, int] = {}
    real = ThreadComm.all_gather

    def spy(comm, t, axis, dim):
        if comm.rank == 0:
            sent[str(t.dtype)] = sent.get(str(t.dtype), 0) + t.numel()
        return real(comm, t, axis, dim)
    monkeypatch.setattr(ThreadComm, "all_gather", spy)

    def run(pm, comm):
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        losses, grads = [], None
        for _ in range(3):
            opt.zero_grad()
            losses.append(pm.train_step(*ex.inputs, target=ex.target).item())
            grads = grads or pm.full_grads()
            pm.step(opt)
        return losses, grads, pm.full_state_dict()
    runs, moved = {}, {}
    world = math.prod(pins.get(a, 1) for a in ("data", "tensor"))
    planned = {on: plan_captured(cap, parse_cluster(f"cpu:{world}"), world,
                                 pins={**pins, "zero": 3, "fp8_all_gather": on, **FP8})
               for on in (True, False)}
    for on in (True, False):
        assert planned[on].options.fp8_gathers == on
        # both runs take the fp8 plan's layout: the two plannings price the gathers
        # differently, and on a cpu: cluster (measured op times) a near tie between layouts
        # can fall either way, which would change the sums' order and so the bits
        plan = dataclasses.replace(planned[True], options=planned[on].options)
        sent.clear()
        runs[on] = simulate(cap, plan, copy.deepcopy(ex.model), run)
        moved[on] = dict(sent)
    assert moved[True].get("torch.uint8", 0) > 0 and "torch.uint8" not in moved[False], moved
    # the bytes that were bf16 became fp8: bf16's elements fell by the uint8 ones
    assert moved[False]["torch.bfloat16"] - moved[True]["torch.bfloat16"] == moved[True]["torch.uint8"]
    for (l8, g8, w8), (l16, g16, w16) in zip(runs[True], runs[False]):
        assert l8 == l16
        assert g8.keys() == g16.keys() and all(torch.equal(g8[k], g16[k]) for k in g16)
        assert w8.keys() == w16.keys() and all(torch.equal(w8[k], w16[k]) for k in w16)


def test_fp8_gathered_linear_casts_only_its_shard(tables):
    """The fp8 linear whose W arrives from the fp8 gather no longer casts W (forward, and
    again in backward): its price swaps those casts for its shard's (half of W on 2 ranks),
    in forward and again for backward's gather, and keeps backward's column-major copy of
    the gathered W (``ops.fp8._mm``): the difference is exactly those casts' times."""
    on, off = tables[True][1], tables[False][1]
    dev = on.cost.cluster.device
    tw = (CAST_BYTES_PER_ELEMENT, CAST_KERNELS)
    compared = 0
    for rep in on.cost.fp8_nodes:
        v = on.problem.vars[rep]
        for j, combo in enumerate(v.options):
            w = _local(v.call.inputs[1], input_placements(combo, 1), on.cost.mesh_shape)
            if gathered_in_fp8(on.cost, combo, w) != 2:
                continue
            nw = math.prod(w.shape)
            f8, b8 = on.option(rep, j).forward_s, on.option(rep, j).backward_s
            f16, b16 = off.option(rep, j).forward_s, off.option(rep, j).backward_s
            assert f16 - f8 == pytest.approx(cast_time(nw, dev, *tw) - cast_time(nw / 2, dev, *tw),
                                             rel=1e-6)
            assert b16 - b8 == pytest.approx(cast_time(nw, dev, tw[0] + TRANSPOSE[0], tw[1] + TRANSPOSE[1])
                                             - cast_time(nw / 2, dev, *tw) - cast_time(nw, dev, *TRANSPOSE),
                                             rel=1e-6)
            compared += 1
    assert compared >= 4
