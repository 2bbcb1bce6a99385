"""Cost models against their hand formulas: FLOPs per op family, collectives, ZeRO memory,
cluster presets and mesh-axis links."""
import math

import pytest
import torch

from autopar.cost_models import comm, compute, hardware, memory
from autopar.cost_models.comm import collective_time, grad_sync_time
from autopar.cost_models.compute import bytes_moved, flops, node_time
from autopar.cost_models.hardware import A100_80GB, Link, axis_link, parse_cluster
from autopar.cost_models.memory import training_state_bytes
from autopar.options import Options
from autopar.sharding.registry import TensorMeta

aten = torch.ops.aten
F32, BF16 = torch.float32, torch.bfloat16


def T(*shape, dtype=F32):
    return TensorMeta(tuple(shape), dtype)


def call(op, args, out, kwargs=None):
    """(op, inputs, outputs, args, kwargs) with the tensor inputs taken from args."""
    kwargs = kwargs or {}
    inputs = [a for a in list(args) + list(kwargs.values()) if isinstance(a, TensorMeta)]
    for a in args:
        if isinstance(a, (list, tuple)):
            inputs += [t for t in a if isinstance(t, TensorMeta)]
    outs = out if isinstance(out, list) else [out]
    return op, inputs, outs, tuple(args), kwargs


# --- FLOPs ---------------------------------------------------------------------------------
def test_matmul_family_flops():
    m, k, n, b = 32, 64, 48, 3
    assert flops(*call(aten.mm.default, (T(m, k), T(k, n)), T(m, n))) == 2 * m * n * k
    assert flops(*call(aten.bmm.default, (T(b, m, k), T(b, k, n)), T(b, m, n))) == 2 * b * m * n * k
    assert flops(*call(aten.matmul.default, (T(b, m, k), T(k, n)), T(b, m, n))) == 2 * b * m * n * k
    assert flops(*call(aten.addmm.default, (T(n), T(m, k), T(k, n)), T(m, n))) == 2 * m * n * k + m * n
    x, w, bias = T(b, m, k), T(n, k), T(n)
    assert flops(*call(aten.linear.default, (x, w), T(b, m, n))) == 2 * b * m * n * k
    assert flops(*call(aten.linear.default, (x, w, bias), T(b, m, n))) == 2 * b * m * n * k + b * m * n
    assert flops(*call(aten.einsum.default, ("bik,bkj->bij", [T(b, m, k), T(b, k, n)]),
                       T(b, m, n))) == 2 * b * m * n * k
    assert flops(*call(aten.einsum.default, ("...k,kj->...j", [T(b, m, k), T(k, n)]),
                       T(b, m, n))) == 2 * b * m * n * k


def test_shapes_come_from_local_inputs_not_global_args():
    """The solver passes local (sharded) inputs / outputs with the global call's args."""
    m, k, n, b = 32, 64, 48, 4
    glob = (T(b, m, k), T(k, n))
    local_in, local_out = [T(b // 2, m, k), T(k, n)], [T(b // 2, m, n)]
    assert flops(aten.einsum.default, local_in, local_out, ("bmk,kn->bmn", list(glob)), {}) \
        == 2 * (b // 2) * m * n * k
    x, w, bias = T(b, m, k), T(n, k), T(n)
    assert flops(aten.linear.default, [T(b, m, k), T(n // 2, k), T(n // 2)], [T(b, m, n // 2)],
                 (x, w, bias), {}) == 2 * b * m * (n // 2) * k + b * m * (n // 2)


def test_conv_flops():
    N, Cin, Cout, H, W, kh, kw = 2, 3, 8, 16, 16, 3, 3
    Hout, Wout = 8, 8  # stride 2, padding 1
    x, w = T(N, Cin, H, W), T(Cout, Cin, kh, kw)
    out = T(N, Cout, Hout, Wout)
    hand = 2 * N * Cout * Hout * Wout * Cin * kh * kw
    assert flops(*call(aten.conv2d.default, (x, w, None, [2, 2], [1, 1]), out)) == hand
    assert flops(*call(aten.conv2d.default, (x, w, T(Cout), [2, 2], [1, 1]), out)) == hand + out.numel
    # groups: the weight holds Cin/groups input channels
    xg, wg = T(N, 4, H, W), T(Cout, 2, kh, kw)
    assert flops(*call(aten.conv2d.default, (xg, wg, None, [2, 2], [1, 1], [1, 1], 2), out)) \
        == 2 * N * Cout * Hout * Wout * 2 * kh * kw
    # transposed: every input pixel scatters Cout*kh*kw products
    wt = T(Cin, Cout, kh, kw)
    assert flops(*call(aten.conv_transpose2d.input, (x, wt), T(N, Cout, 18, 18))) \
        == 2 * N * Cin * H * W * Cout * kh * kw
    assert flops(*call(aten.convolution.default,
                       (x, wt, None, [1, 1], [0, 0], [1, 1], True, [0, 0], 1),
                       T(N, Cout, 18, 18))) == 2 * N * Cin * H * W * Cout * kh * kw


def test_attention_flops():
    B, H, S, D = 2, 4, 128, 32
    q = T(B, H, S, D)
    hand = 4 * B * H * S * S * D
    op = aten.scaled_dot_product_attention.default
    assert flops(*call(op, (q, T(B, H, S, D), T(B, H, S, D)), T(B, H, S, D))) == hand
    assert flops(*call(op, (q, T(B, H, S, D), T(B, H, S, D), None, 0.0, True),
                       T(B, H, S, D))) == hand / 2
    assert flops(*call(op, (q, T(B, H, S, D), T(B, H, S, D)), T(B, H, S, D),
                       {"is_causal": True})) == hand / 2
    # grouped-query attention: the cost follows the query heads
    assert flops(*call(op, (q, T(B, 1, S, D), T(B, 1, S, D)), T(B, H, S, D),
                       {"enable_gqa": True})) == hand
    # cross attention, Skv != Sq
    assert flops(*call(op, (q, T(B, H, 64, D), T(B, H, 64, D)), T(B, H, S, D))) \
        == 4 * B * H * S * 64 * D


def test_norm_softmax_loss_flops():
    x = T(4, 16, 64)
    N = x.numel
    assert flops(*call(aten.layer_norm.default, (x, [64], T(64), T(64), 1e-5), x)) == 7 * N
    assert flops(*call(aten.layer_norm.default, (x, [64], None, None, 1e-5), x)) == 5 * N
    assert flops(*call(aten.rms_norm.default, (x, [64], T(64)), x)) == 4 * N
    assert flops(*call(aten.rms_norm.default, (x, [64]), x)) == 3 * N
    img = T(2, 8, 5, 5)
    assert flops(*call(aten.batch_norm.default,
                       (img, T(8), T(8), T(8), T(8), True, 0.1, 1e-5, False), img)) == 7 * img.numel
    assert flops(*call(aten.softmax.int, (x, -1), x)) == 5 * N
    assert flops(*call(aten._log_softmax.default, (x, -1, False), x)) == 5 * N
    logits, target = T(32, 100), T(32, dtype=torch.int64)
    assert flops(*call(aten.cross_entropy_loss.default, (logits, target), T())) == 5 * 3200 + 32
    assert flops(*call(aten.nll_loss_forward.default, (logits, target, None, 1, -100),
                       [T(), T()])) == 32


def test_elementwise_reduction_embedding_view_flops():
    x = T(8, 32)
    assert flops(*call(aten.gelu.default, (x,), x)) == x.numel
    assert flops(*call(aten.add.Tensor, (x, T(32)), x)) == x.numel
    assert flops(*call(aten.mul.Tensor, (x, 2.0), x)) == x.numel
    assert flops(*call(aten.dropout.default, (x, 0.1, True), x)) == 2 * x.numel
    assert flops(*call(aten.sum.default, (x,), T())) == x.numel
    assert flops(*call(aten.mean.dim, (x, [1]), T(8))) == x.numel
    assert flops(*call(aten.var.correction, (x, [1]), T(8))) == 3 * x.numel
    assert flops(*call(aten.embedding.default, (T(1000, 32), T(8, dtype=torch.int64)), T(8, 32))) == 0
    for op, args, out in [(aten.view.default, (x, [256]), T(256)),
                          (aten.transpose.int, (x, 0, 1), T(32, 8)),
                          (aten.expand.default, (T(1, 32), [8, 32]), x)]:
        assert flops(*call(op, args, out)) == 0
        assert bytes_moved(*call(op, args, out)) == 0
        assert node_time(*call(op, args, out), device=A100_80GB) == (0.0, 0.0)


def test_every_node_of_an_exported_model_is_costed():
    """Sweep a real training-IR graph: every node gets finite, non-negative costs."""
    from autopar.sharding.registry import make_call

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 16)
            self.ln = torch.nn.LayerNorm(16)
            self.qkv = torch.nn.Linear(16, 48)
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.bn = torch.nn.BatchNorm2d(4)
            self.head = torch.nn.Linear(16, 50, bias=False)

        def forward(self, ids, img, tgt):
            x = self.ln(self.emb(ids))
            q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).unbind(2)
            a = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + torch.nn.functional.gelu(a.transpose(1, 2).reshape(2, 8, 16))
            c = self.bn(self.conv(img)).relu().mean()
            y = self.head(x)
            return torch.nn.functional.cross_entropy(y.view(-1, 50), tgt.view(-1)) + c

    ep = torch.export.export(M(), (torch.randint(0, 50, (2, 8)), torch.randn(2, 3, 8, 8),
                                   torch.randint(0, 50, (2, 8))))
    seen = set()
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        c = make_call(node)
        f = flops(c.op, c.inputs, c.outputs, c.args, c.kwargs)
        b = bytes_moved(c.op, c.inputs, c.outputs, c.args, c.kwargs)
        fw, bw = node_time(c.op, c.inputs, c.outputs, c.args, c.kwargs, device=A100_80GB)
        assert all(math.isfinite(v) and v >= 0 for v in (f, b, fw, bw)), node
        seen.add(compute.op_name(c.op))
    assert {"embedding", "layer_norm", "linear", "scaled_dot_product_attention", "conv2d",
            "batch_norm", "cross_entropy_loss"} <= seen
    assert not compute.UNKNOWN_OPS & seen, compute.UNKNOWN_OPS & seen


# --- bytes and time --------------------------------------------------------------------------
def test_bytes_moved():
    m, k, n = 32, 64, 48
    assert bytes_moved(*call(aten.mm.default, (T(m, k), T(k, n)), T(m, n))) == 4 * (m * k + k * n + m * n)
    x = T(8, 32, dtype=BF16)
    assert bytes_moved(*call(aten.gelu.default, (x,), x)) == 2 * 2 * 256
    # embedding reads only the gathered rows (and the ids), not the table
    ids, out = T(8, dtype=torch.int64), T(8, 32)
    assert bytes_moved(*call(aten.embedding.default, (T(10**6, 32), ids), out)) == 2 * 8 * 32 * 4 + 8 * 8


def test_node_time_roofline():
    dev = A100_80GB
    n = 8192
    mm = call(aten.mm.default, (T(n, n, dtype=BF16), T(n, n, dtype=BF16)), T(n, n, dtype=BF16))
    fwd, bwd = node_time(*mm, device=dev, dtype_key="bf16")
    # 2048 output tiles over 108 SMs: 19 waves for 18.96 of work (wave quantization)
    rate = dev.peak_flops["bf16"] * dev.max_efficiency / compute._tiles(n, n, 1, dev)
    assert fwd == pytest.approx(2 * n**3 / rate + dev.fill_time + dev.launch_overhead)
    assert bwd == pytest.approx(2 * (2 * n**3 / rate + dev.fill_time + dev.launch_overhead))
    assert node_time(*mm, device=dev, dtype_key=None) == (fwd, bwd)  # dtype from inputs
    assert node_time(*mm, device=dev, dtype_key="fp32")[0] > 10 * fwd
    # memory bound: an elementwise op streams its bytes
    x = T(64, 2**20)
    fwd, bwd = node_time(*call(aten.gelu.default, (x,), x), device=dev)
    bw = dev.mem_bandwidth * dev.mem_efficiency
    assert fwd == pytest.approx(2 * x.nbytes / bw + dev.launch_overhead)
    assert bwd == pytest.approx(1.5 * 2 * x.nbytes / bw + dev.launch_overhead)
    # add passes its gradient through
    assert node_time(*call(aten.add.Tensor, (x, x), x), device=dev)[1] == 0
    # integer ops have no backward
    i = T(8, 8, dtype=torch.int64)
    assert node_time(*call(aten.eq.Tensor, (i, i), T(8, 8, dtype=torch.bool)), device=dev)[1] == 0


def test_efficiency_rises_with_size():
    dev = A100_80GB
    effs = [compute.efficiency(2.0 * s**3, dev, "bf16") for s in (64, 256, 1024, 4096, 16384)]
    assert effs == sorted(effs)
    assert effs[0] < 0.1 * dev.max_efficiency and effs[-1] > 0.95 * dev.max_efficiency
    f_half = dev.peak_flops["bf16"] * dev.max_efficiency * dev.fill_time
    assert compute.efficiency(f_half, dev, "bf16") == pytest.approx(dev.max_efficiency / 2)


# --- collectives ------------------------------------------------------------------------------
LINK = Link(bandwidth=100e9, latency=5e-6)


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_collective_formulas(n):
    S, B, a = 1e9, LINK.bandwidth, LINK.latency
    assert collective_time("all_reduce", S, n, LINK) == pytest.approx(2 * (n - 1) / n * S / B + 2 * (n - 1) * a)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert collective_time(kind, S, n, LINK) == pytest.approx((n - 1) / n * S / B + (n - 1) * a)
    for kind in ("send", "recv"):
        assert collective_time(kind, S, n, LINK) == pytest.approx(S / B + a)
    for kind in comm.COLLECTIVES:
        assert collective_time(kind, S, 1, LINK) == 0.0


def test_collective_errors():
    with pytest.raises(ValueError, match="all_reduce"):
        collective_time("allreduce_fancy", 1e6, 4, LINK)
    assert collective_time("allreduce", 1e6, 4, LINK) == collective_time("all_reduce", 1e6, 4, LINK)


def test_grad_sync_overlap():
    G, n = 100 * 2**20, 8  # 4 buckets of 25 MiB
    t_b = collective_time("all_reduce", G / 4, n, LINK)
    long = grad_sync_time(G, n, LINK, backward_time=1.0)
    assert long.total == pytest.approx(4 * t_b)
    assert long.exposed == pytest.approx(t_b)  # only the last bucket shows
    none = grad_sync_time(G, n, LINK, backward_time=0.0)
    assert none.exposed == pytest.approx(none.total)
    mid = grad_sync_time(G, n, LINK, backward_time=2 * t_b)
    assert mid.exposed == pytest.approx(4 * t_b - 2 * t_b * 0.75)
    assert grad_sync_time(G, 1, LINK, 1.0) == (0.0, 0.0)


# --- memory -----------------------------------------------------------------------------------
@pytest.mark.parametrize("zero,expect", [
    (0, (2, 4, 12)), (1, (2, 4, 12 / 8)), (2, (2, 4 / 8, 12 / 8)), (3, (2 / 8, 4 / 8, 12 / 8))])
def test_zero_memory_mixed_adam(zero, expect):
    psi = 10**9
    got = training_state_bytes(psi, "adamw", "bf16", zero=zero, dp=8)
    assert (got["params"], got["grads"], got["optimizer"]) == pytest.approx(tuple(e * psi for e in expect))


def test_fp32_memory_by_optimizer():
    psi = 1000
    assert training_state_bytes(psi, "adamw", "fp32") == {"params": 4000, "grads": 4000, "optimizer": 8000}
    assert training_state_bytes(psi, "sgd_momentum", "fp32")["optimizer"] == 4000
    assert training_state_bytes(psi, "sgd", "fp32")["optimizer"] == 0
    with pytest.raises(ValueError, match="lamb"):
        training_state_bytes(psi, "lamb")
    assert memory.allocator_overhead(1000.0) == pytest.approx(1100.0)
    assert memory.allocation_size(1) == 512 and memory.allocation_size(11 * 2**20 + 1) == 12 * 2**20


# --- clusters ---------------------------------------------------------------------------------
def test_parse_cluster_presets():
    c = parse_cluster("4x8xH100")
    assert (c.nodes, c.devices_per_node, c.world_size) == (4, 8, 32)
    assert c.device is hardware.H100_80GB and c.intra.bandwidth > c.inter.bandwidth / 8
    c = parse_cluster("128xdgx-a100")
    assert (c.nodes, c.devices_per_node, c.world_size, c.device) == (128, 8, 1024, hardware.A100_80GB)
    assert c.inter.bandwidth == pytest.approx(0.9 * 8 * 200e9 / 8)  # 8 x 200 Gb/s HDR at 90%
    c = parse_cluster("16xdgx-h100")
    assert c.world_size == 128 and c.device.name.startswith("H100")
    c = parse_cluster("8xA100")
    assert (c.nodes, c.devices_per_node) == (1, 8)
    assert parse_cluster("2x8xH200").device.memory_bytes == 141e9
    assert parse_cluster(c) is c


def test_world_size_takes_the_first_devices_of_a_cluster():
    """``plan(world_size=W, cluster=C)`` plans for C's first W devices: a node's worth on one
    node, else whole nodes; CPU ranks as W processes sharing the cores. It was refused deep in
    the cost model with "plan for at most N devices" for any W < N (``local`` included)."""
    c = hardware.devices_of(parse_cluster("4x8xH100"), 16)
    assert (c.nodes, c.devices_per_node, c.device) == (2, 8, hardware.H100_80GB)
    assert parse_cluster(c.name) == c                # the plan's cluster parses back
    c = hardware.devices_of(parse_cluster("4x8xH100"), 4)
    assert (c.nodes, c.devices_per_node) == (1, 4) and parse_cluster(c.name) == c
    assert hardware.devices_of(parse_cluster("256xdgx-h800"), 16).name == "2x8xH800"
    assert hardware.devices_of(parse_cluster("cpu:4"), 2) == parse_cluster("cpu:2")
    four = parse_cluster("cpu:4")
    assert hardware.devices_of(four, 4) is four
    with pytest.raises(hardware.ClusterError, match="multiple of 8"):
        hardware.devices_of(parse_cluster("4x8xH100"), 12)
    with pytest.raises(hardware.ClusterError, match="world_size=5: cluster 'cpu:4' has 4 devices"):
        hardware.devices_of(four, 5)


def test_parse_cluster_cpu():
    c = parse_cluster("cpu:4")
    assert (c.nodes, c.devices_per_node, c.world_size) == (1, 4, 4)
    assert c.device.peak_flops["fp32"] > 1e8 and c.device.mem_bandwidth > 1e8
    assert c.intra.bandwidth > 0 and c.intra.latency > 0
    assert parse_cluster("local").nodes == 1


@pytest.mark.parametrize("spec", ["3xTPU", "x8xH100", "", "dgx-a100", "0x8xA100", "cpu:0"])
def test_parse_cluster_bad_spec(spec):
    with pytest.raises(ValueError) as e:
        parse_cluster(spec)
    assert repr(spec) in str(e.value) and "dgx-a100" in str(e.value)


def test_axis_link_intra_vs_inter():
    c = parse_cluster("16xdgx-a100")
    assert axis_link(c, (16, 8), 1) == c.intra
    inter = axis_link(c, (16, 8), 0)  # one device per node: one NIC's share
    assert inter.bandwidth == pytest.approx(c.inter.bandwidth / 8)
    assert axis_link(c, (8, 16), 1).bandwidth == pytest.approx(c.inter.bandwidth)  # 2 whole nodes
    assert axis_link(c, (4, 4, 8), 2) == c.intra
    assert axis_link(c, (4, 4, 8), 1).bandwidth == pytest.approx(c.inter.bandwidth / 8)
    assert axis_link(c, (32, 4), 1) == c.intra  # groups of 4 inside a node
    assert axis_link(c, (32, 4), 0).bandwidth == pytest.approx(c.inter.bandwidth * 2 / 8)
    with pytest.raises(ValueError, match="128"):
        axis_link(c, (4, 8), 0)


def test_zero3_and_recompute_pay_their_forward_collectives_again():
    """A ZeRO-3 weight is gathered in forward and again for backward; a recomputed consumer
    runs its forward redistributions a second time in backward. (The baseline, zero=0, is a
    weight the plan stores sharded: gathered per use, kept for backward.)"""
    import torch

    from autopar.cost_models.comm import collective_time
    from autopar.cost_models.hardware import parse_cluster
    from autopar.placement import Replicate, Shard
    from autopar.sharding.registry import TensorMeta
    from autopar.pricing.costing import CostModel

    cl = parse_cluster("1xdgx-a100")
    meta = TensorMeta((4096, 4096), torch.float32)
    sharded, whole = (Shard(0),), (Replicate(),)
    nbytes = 4096 * 4096 * 4
    link = CostModel(cl, (8,)).links[0]
    gather = collective_time("all_gather", nbytes, 8, link)
    scatter = collective_time("reduce_scatter", nbytes, 8, link)

    def cost(zero, rerun=0.0):
        model = CostModel(cl, (8,), Options(zero=zero), data_axis=0)
        t, by = model.edge_time(meta, sharded, whole, (True,), bucketed=True, rerun=rerun)
        return t, by

    # ZeRO-3 copies each gathered buffer out into whole weights on the compute stream:
    # read and written once, per gather (FSDP2's foreach_all_gather_copy_out)
    copy = 2 * nbytes / (cl.device.mem_bandwidth * cl.device.mem_efficiency)
    t2, by2 = cost(zero=0)
    t3, by3 = cost(zero=3)
    assert by2[("all_gather", 0)] == pytest.approx(gather)
    assert ("copy_out", 0) not in by2
    assert by3[("all_gather", 0)] == pytest.approx(2 * gather)
    assert by3[("copy_out", 0)] == pytest.approx(2 * copy)
    assert t3 - t2 == pytest.approx(gather + 2 * copy)
    assert by3[("reduce_scatter", 0)] == pytest.approx(by2[("reduce_scatter", 0)])
    assert by2[("reduce_scatter", 0)] <= scatter          # bucketed: no latency of its own
    t_rec, by_rec = cost(zero=0, rerun=1.0)
    assert by_rec[("all_gather", 0)] == pytest.approx(2 * gather)
    assert by_rec[("reduce_scatter", 0)] == pytest.approx(by2[("reduce_scatter", 0)])


def test_wait_for_peers_once_per_collective_shared_by_a_consumers_parameters():
    """CPU ranks wait for their last peer (``Link.skew``) once per collective between
    computations; a consumer's parameter gathers go back to back and share one wait; the
    bucketed gradient all-reduce pays none."""
    import torch

    from autopar.cost_models.comm import collective_time
    from autopar.cost_models.hardware import parse_cluster
    from autopar.placement import Partial, Replicate, Shard
    from autopar.sharding.registry import TensorMeta
    from autopar.pricing.costing import CostModel

    cl = parse_cluster("cpu:2")
    model = CostModel(cl, (2,), Options(zero=0), data_axis=0)
    link = model.links[0]
    assert link.skew > 0
    meta = TensorMeta((256, 256), torch.float32)
    nbytes = 256 * 256 * 4
    # an activation: all_reduce of a partial sum, one wait
    t, _ = model.edge_time(meta, (Partial(),), (Replicate(),), (False,))
    assert t == pytest.approx(collective_time("all_reduce", nbytes, 2, link, skew=False) + link.skew)
    # a weight stored sharded read by a consumer of two parameters: gather and gradient reduce-scatter
    # each pay half a wait
    one, _ = model.edge_time(meta, (Shard(0),), (Replicate(),), (True,), bucketed=True, shared=1)
    two, _ = model.edge_time(meta, (Shard(0),), (Replicate(),), (True,), bucketed=True, shared=2)
    assert one - two == pytest.approx(link.skew)          # 2 collectives x (1 - 1/2) wait
    # a replicated weight's gradient all-reduce (bucketed): no wait, no latency of its own
    t, _ = model.edge_time(meta, (Replicate(),), (Replicate(),), (True,), bucketed=True)
    assert t == pytest.approx(collective_time("all_reduce", nbytes, 2, link, skew=False)
                              - collective_time("all_reduce", 1.0, 2, link, skew=False))


def test_mixed_precision_halves_an_fp32_capture_not_a_native_one():
    """Under a 16-bit precision an fp32 capture's tensors move at 16 bits (autocast's view);
    a graph captured in 16 bits (``native``) keeps the fp32 its model makes itself: a norm's
    ``x.float()`` statistics move at 32 bits."""
    dev = A100_80GB
    x = T(64, 2**20)                         # fp32: an upcast norm input, or a whole fp32 capture
    pow_ = call(aten.pow.Tensor_Scalar, (x, 2), x)
    bw = dev.mem_bandwidth * dev.mem_efficiency
    mixed = node_time(*pow_, device=dev, dtype_key="bf16")
    native = node_time(*pow_, device=dev, dtype_key="bf16", native=True)
    assert mixed[0] == pytest.approx(x.nbytes / bw + dev.launch_overhead)
    assert native[0] == pytest.approx(2 * x.nbytes / bw + dev.launch_overhead)
    # a bf16 tensor is bf16 either way
    y = T(64, 2**20, dtype=BF16)
    gelu = call(aten.gelu.default, (y,), y)
    assert node_time(*gelu, device=dev, dtype_key="bf16") == node_time(*gelu, device=dev,
                                                                       dtype_key="bf16", native=True)


def test_a_bf16_model_is_priced_in_its_own_dtypes():
    """``Captured.native_dtypes`` of a Llama cast to bf16 (FSDP2's ``param_dtype``) is set, of
    the fp32 one not; under ``precision='bf16'`` the bf16 capture costs more: its RMSNorm
    statistics and the loss's upcast logits are fp32 tensors, priced at 32 bits."""
    import torch.nn.functional as F

    from autopar.capture import capture
    from autopar.pricing.costing import CostModel
    from autopar.pricing.prices import price_table
    from autopar.pricing.problem import build_problem
    from examples.llama import Llama, LlamaConfig

    def loss(logits, target):
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(0, 1))

    cfg = LlamaConfig(vocab_size=32000, max_seq_len=1024, n_layer=2, dim=1024, n_head=8,
                      n_kv_head=2, hidden_dim=2048)
    cl = parse_cluster("1x1xA100")
    costs = {}
    for dtype in (torch.float32, torch.bfloat16):
        with torch.device("meta"):
            model = Llama(cfg).to(dtype)
        tokens = torch.zeros(8, 1024, dtype=torch.long, device="meta")
        cap = capture(model, (tokens,), loss, target=tokens)
        assert cap.native_dtypes == (dtype == torch.bfloat16)
        problem = build_problem(cap, (1,))
        cost = CostModel.for_pins(cl, (1,), {"precision": "bf16"}, native=cap.native_dtypes)
        table = price_table(problem, cost)
        costs[dtype] = sum(table.option(n, 0).forward_s for n in problem.vars)
    assert costs[torch.bfloat16] > 1.05 * costs[torch.float32]


def test_gradients_are_reduced_in_fp32_under_mixed_precision_unless_pinned():
    """The runtime reduces parameter gradients in fp32 under mixed precision
    (``runtime.precision.grad_reduce_dtype``) unless ``grad_reduce="bf16"``: the cost model
    prices the data-parallel all-reduce at those bytes, for an fp32 capture and a bf16 one,
    while activations' collectives move 16 bits."""
    from autopar.placement import Partial, Replicate
    from autopar.pricing.costing import CostModel

    cl = parse_cluster("1xdgx-a100")
    link = CostModel(cl, (8,)).links[0]
    n = 4096 * 4096

    def allreduce(elem_bytes):
        return (collective_time("all_reduce", n * elem_bytes, 8, link, skew=False)
                - collective_time("all_reduce", 1.0, 8, link, skew=False))

    for dtype in (F32, BF16):
        meta = TensorMeta((4096, 4096), dtype)
        for pins, elem in (({"precision": "bf16"}, 4), ({"precision": "bf16", "grad_reduce": "bf16"}, 2),
                           ({}, dtype.itemsize)):
            model = CostModel.for_pins(cl, (8,), pins, data_axis=0, native=dtype == BF16)
            t, by = model.edge_time(meta, (Replicate(),), (Replicate(),), (True,), bucketed=True)
            assert by[("all_reduce", 0)] == pytest.approx(allreduce(elem)), (dtype, pins)
    # an activation's partial sum moves at 16 bits under mixed precision
    model = CostModel.for_pins(cl, (8,), {"precision": "bf16"}, data_axis=0)
    t, _ = model.edge_time(TensorMeta((4096, 4096), F32), (Partial(),), (Replicate(),), (False,))
    assert t == pytest.approx(collective_time("all_reduce", n * 2, 8, link, skew=False) + link.skew)
