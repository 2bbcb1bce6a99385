"""Each pipeline boundary priced on the link it crosses (issue 39, item 2): NVLink where the
two stages share a node, the rank's own NIC where they sit on two nodes (DGX: one
200 Gb/s HDR NIC per A100, ``gpus.IB_8xHDR`` / 8; NVLink3 ``gpus.NVLINK3``). Pure
functions and presets: no planning, no processes."""
from __future__ import annotations

import numpy as np
import pytest

from autopar.cost_models.gpus import IB_8xHDR, NVLINK3
from autopar.cost_models.hardware import parse_cluster
from autopar.solver.pipeline_price import Priced, cut_crosses_nodes, pipeline_link


def test_boundaries_inside_a_node_do_not_cross():
    # tensor 2, no data parallelism, 8 GPUs a node: 4 stages a node, the 4th boundary crosses
    assert [cut_crosses_nodes(k, k + 1, 2, 8) for k in range(7)] == \
        [False, False, False, True, False, False, False]
    # one stage a node (d = 8) or more: every boundary crosses
    assert all(cut_crosses_nodes(k, k + 1, 8, 8) for k in range(7))
    assert all(cut_crosses_nodes(k, k + 1, 16, 8) for k in range(3))
    # d = 3 on 8-GPU nodes: ranks 6-8 straddle nodes 0 and 1, so 1 -> 2 and 2 -> 3 cross
    assert [cut_crosses_nodes(k, k + 1, 3, 8) for k in range(3)] == [False, True, True]
    # one node, and the wrap of virtual stages onto the same rank
    assert not cut_crosses_nodes(0, 1, 2, 0)
    assert not cut_crosses_nodes(3, 3, 2, 8)
    # the wrap of interleaved stages from the last pipeline rank to the first
    assert cut_crosses_nodes(3, 0, 2, 8) is False and cut_crosses_nodes(7, 0, 2, 8) is True


def _priced(cluster: str, p: int) -> Priced:
    cl = parse_cluster(cluster)
    world = cl.world_size
    far, lat = pipeline_link(cl, world // p, world)
    near, _ = pipeline_link(cl, world // p, 1)
    return Priced(None, None, None, None, np.zeros(2, int), far, lat, near_bandwidth=near,
                  ranks_apart=world // p, devices_per_node=cl.devices_per_node if cl.nodes > 1 else 0)


def test_a_cut_between_nodes_costs_the_link_ratio_more():
    """2 DGX A100, tensor 2 x pipeline 8: the boundary between the nodes runs on one HDR NIC
    per rank (22.5 GB/s), the six inside them on NVLink (246 GB/s): a message across
    takes NVLink / NIC = 10.9 times as long."""
    pr = _priced("2xdgx-a100", 8)
    bws = pr.cut_bandwidths(8, 8)
    nic, nvlink = IB_8xHDR.bandwidth / 8, NVLINK3.bandwidth
    assert bws == pytest.approx([nvlink] * 3 + [nic] + [nvlink] * 3)
    nbytes = 64 * 2**20
    across, inside = nbytes / bws[3], nbytes / bws[0]
    assert across / inside == pytest.approx(nvlink / nic) and across / inside > 10
    # interleaved: 16 stages on 8 ranks, the wrap 7 -> 0 crosses back to node 0
    bws2 = pr.cut_bandwidths(8, 16)
    assert len(bws2) == 15 and bws2[7] == pytest.approx(nic) and bws2[11] == pytest.approx(nic)
    assert sum(b == pytest.approx(nic) for b in bws2) == 3


def test_one_stage_a_node_and_one_node_keep_their_single_rate():
    # tensor 8: every boundary between nodes, each at one NIC per rank (as before)
    pr = _priced("4xdgx-a100", 4)
    assert pr.cut_bandwidths(4, 4) == pytest.approx([IB_8xHDR.bandwidth / 8] * 3)
    # one node: NVLink everywhere (and the CPU's gloo ranks: their one link)
    assert _priced("8xA100", 4).cut_bandwidths(4, 4) == pytest.approx([NVLINK3.bandwidth] * 3)
    cpu = _priced("cpu:4", 2)
    assert cpu.cut_bandwidths(2, 2) == [cpu.bandwidth]


def test_many_stages_keep_every_block_boundary_as_a_cut_point():
    """128 blocks of 10 chain positions, the residual's bytes alone crossing before offsets
    4, 7 and 10 of one block and 5 and 10 of the next (2.5 points a block, as the GPT 1T
    chain of K22 Table 5: 323 such points): 64 stages need the boundary after every second
    block. Thinned evenly to a fixed 256, a fifth of the points go and with them block
    boundaries (that row then held 2.5 blocks on 10 of its 64 stages)."""
    from autopar.solver.pipeline_price import MAX_UNITS, cut_points, max_units
    a = [5.0, 5.0, 5.0, 1.0, 5.0, 5.0, 1.0, 5.0, 5.0, 1.0]
    b = [5.0, 5.0, 5.0, 5.0, 1.0, 5.0, 5.0, 5.0, 5.0, 1.0]
    cross = np.array((a + b) * 64 + [5.0] * 9)
    boundaries = {10 * k for k in range(1, 128)}
    assert max_units(64) == 512 and max_units(4) == MAX_UNITS
    points = cut_points(cross, 64)
    assert boundaries <= set(points) and 320 <= len(points) <= max_units(64)
    # the fixed cap of 256 (32 stages) loses block boundaries: the case this guards
    lost = boundaries - set(cut_points(cross, 32))
    assert len(lost) > 10


def test_a_plans_sends_are_priced_per_boundary(monkeypatch):
    """A planned pipeline (tensor 2 x pipeline 4 on two nodes of 4 A100s: stages 0-1 on one
    node, 2-3 on the other): its estimate's sends on the busiest rank are each boundary's
    bytes at that boundary's link, NVLink for 0-1 and 2-3, a rank's NIC share for 1-2."""
    import torch
    import autopar
    import autopar.solver.pipeline_search as ps
    from examples.models import gpt_factory
    seen = {}
    real = ps.pipeline_estimate

    def spy(pr, config, cuts):
        seen.update(pr=pr, config=config, cuts=cuts)
        return real(pr, config, cuts)
    monkeypatch.setattr(ps, "pipeline_estimate", spy)
    with torch.device("meta"):
        ex = gpt_factory(batch=16, n_layer=4, n_embd=256, n_head=8, block_size=128, vocab_size=512)
    plan = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="2x4xA100",
                        pipeline=4, tensor=2, micro_batch_size=4)
    pr, (p, v, m, _), cuts = seen["pr"], seen["config"], seen["cuts"]
    assert (p, v, pr.ranks_apart, pr.devices_per_node) == (4, 1, 2, 4)
    bws = pr.cut_bandwidths(p, p)
    cl = parse_cluster("2x4xA100")
    assert bws[1] == pytest.approx(cl.inter.bandwidth / 4) and bws[1] < bws[0] / 5
    assert bws[0] == bws[2] == pytest.approx(NVLINK3.bandwidth)
    p2p = [pr.nc.cross[c - 1] / bw + pr.latency for c, bw in zip(cuts, bws)]
    sends = {r: m * ((p2p[r - 1] if r > 0 else 0.0) + (p2p[r] if r < p - 1 else 0.0))
             for r in range(p)}
    got = plan.estimate.comm["send_recv@pipeline"]
    assert any(got == pytest.approx(s) for s in sends.values()), (got, sends)
    # priced at one NIC everywhere (as before), no rank's sends come to the estimate's
    flat = [pr.nc.cross[c - 1] / pr.bandwidth + pr.latency for c in cuts]
    old = [m * ((flat[r - 1] if r > 0 else 0.0) + (flat[r] if r < p - 1 else 0.0))
           for r in range(p)]
    assert all(got != pytest.approx(s) for s in old), (got, old)
