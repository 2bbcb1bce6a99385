"""The GPU cost model's component behaviour: GEMM wave quantization and shape, attention
(unfused scores and fused flash) against the sequence, NCCL bandwidth by message size and
node count, the optimizer step, and a source next to every constant."""
import ast
import math
import pathlib

import pytest
import torch

from autopar.cost_models import compute, gpus, step
from autopar.cost_models.comm import collective_time, grad_sync_time
from autopar.cost_models.compute import node_time
from autopar.cost_models.cpu import cpu_device
from autopar.cost_models.gpus import A100_80GB, H100_80GB
from autopar.cost_models.hardware import axis_link, parse_cluster
from autopar.sharding.registry import TensorMeta

aten = torch.ops.aten
BF16, F32 = torch.bfloat16, torch.float32


def T(*shape, dtype=BF16):
    return TensorMeta(tuple(shape), dtype)


def mm_time(m, n, k, dev=A100_80GB, dtype_key="bf16"):
    a, b, out = T(m, k), T(k, n), T(m, n)
    return node_time(aten.mm.default, [a, b], [out], (a, b), {}, dev, dtype_key)


def linear_time(m, n, k, dev=A100_80GB):
    x, w, out = T(m, k), T(n, k), T(m, n)
    return node_time(aten.linear.default, [x, w], [out], (x, w), {}, dev, "bf16")


# --- GEMM ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dev", [A100_80GB, H100_80GB], ids=["a100", "h100"])
def test_gemm_efficiency_rises_with_size(dev):
    """Achieved TFLOP/s grows with the GEMM (launch, fill, memory-bound small K) toward
    the device's large-GEMM efficiency, and never passes it."""
    peak = dev.peak_flops["bf16"]
    effs = []
    for s in (128, 512, 2048, 8192):
        f = 2.0 * s**3
        effs.append(f / mm_time(s, s, s, dev)[0] / peak)
    assert effs == sorted(effs)
    assert effs[0] < 0.2 and effs[-1] > 0.9 * dev.max_efficiency
    assert max(effs) <= dev.max_efficiency + 1e-12


def test_wave_quantization_one_more_tile_costs_a_wave():
    """108 tiles of 256 x 128 fill one A100 wave; one more row of tiles needs a second
    wave that runs nearly empty, so the GEMM takes almost twice as long for ~1% more work."""
    k = 8192
    # 12 x 9 = 108 tiles of 256 x 128: exactly one wave
    t_full = linear_time(12 * 256, 9 * 128, k)[0]
    t_more = linear_time(12 * 256 + 1, 9 * 128, k)[0]
    assert t_more > 1.8 * t_full
    assert compute._tiles(12 * 256, 9 * 128, 1, A100_80GB) == pytest.approx(1.0)
    assert compute._tiles(12 * 256 + 256, 9 * 128, 1, A100_80GB) == pytest.approx(2 / (117 / 108))
    # H100 has 132 SMs: the same 108 tiles leave 24 idle
    assert compute._tiles(12 * 256, 9 * 128, 1, H100_80GB) == pytest.approx(132 / 108)


def test_small_dimension_pays_for_its_tile():
    """A dimension smaller than the tile wastes part of it: N = 64 in a 128-wide tile
    column takes as long as a GEMM twice as wide would at full tiles (64 is the smallest
    tile side assumed)."""
    assert compute._tiles(256 * 108, 64, 1, A100_80GB) == pytest.approx(1.0)
    assert compute._tiles(256 * 108, 96, 1, A100_80GB) == pytest.approx(128 / 96)


def test_cpu_has_no_waves_and_fp32_bytes():
    """The CPU (measured constants) keeps the plain roofline: no wave factor, and no
    16-bit byte discount (its values are measured in fp32)."""
    cpu = cpu_device()
    assert compute._tiles(1000, 1000, 1, cpu) == 1.0
    x = T(1024, 1024, dtype=F32)
    a = node_time(aten.gelu.default, [x], [x], (x,), {}, cpu, "bf16")
    b = node_time(aten.gelu.default, [x], [x], (x,), {}, cpu, "fp32")
    assert a == b


def test_mixed_precision_moves_16_bit_activations():
    x = T(4096, 4096, dtype=F32)
    t32 = node_time(aten.gelu.default, [x], [x], (x,), {}, A100_80GB, "fp32")[0]
    t16 = node_time(aten.gelu.default, [x], [x], (x,), {}, A100_80GB, "bf16")[0]
    launch = A100_80GB.launch_overhead
    assert (t16 - launch) == pytest.approx((t32 - launch) / 2)


def test_dropout_moves_its_mask_on_gpu():
    """aten.dropout on a GPU runs native_dropout, which writes a bool mask beside the
    output (read again in backward): 5 bytes an element at bf16, as native_dropout's own
    outputs say."""
    x = T(4096, 4096)
    mask = T(4096, 4096, dtype=torch.bool)
    launch = A100_80GB.launch_overhead
    drop = node_time(aten.dropout.default, [x], [x], (x, 0.1, True), {}, A100_80GB, "bf16")
    native = node_time(aten.native_dropout.default, [x], [x, mask], (x, 0.1, True), {},
                       A100_80GB, "bf16")
    assert drop == pytest.approx(native)
    bw = A100_80GB.mem_bandwidth * A100_80GB.mem_efficiency
    assert drop[0] - launch == pytest.approx(5 * 4096 * 4096 / bw)
    assert drop[1] - launch == pytest.approx(5 * 4096 * 4096 / bw)


# --- attention -----------------------------------------------------------------------------
def _unfused_score_ops_time(b, h, s, dev=A100_80GB):
    """Forward + backward of the mask, softmax and dropout over materialised scores."""
    sc = T(b, h, s, s)
    mask = T(s, s, dtype=torch.bool)
    total = 0.0
    for op, ins, outs in ((aten.masked_fill.Scalar, [sc, mask], [sc]),
                          (aten._softmax.default, [sc], [sc]),
                          (aten.native_dropout.default, [sc], [sc, T(b, h, s, s, dtype=torch.bool)])):
        f, bw = node_time(op, ins, outs, tuple(ins), {}, dev, "bf16")
        total += f + bw
    return total


def test_unfused_attention_memory_bound_over_scores_scales_with_s2():
    t1, t2 = _unfused_score_ops_time(4, 16, 1024), _unfused_score_ops_time(4, 16, 2048)
    assert t2 / t1 == pytest.approx(4.0, rel=0.03)      # launches are the constant part
    # and it is HBM-bound: bytes over achieved bandwidth
    elems = 4 * 16 * 2048**2
    bw = A100_80GB.mem_bandwidth * A100_80GB.mem_efficiency
    assert t2 > 2 * 3 * elems * 2 / bw


@pytest.mark.parametrize("dev", [A100_80GB, H100_80GB], ids=["a100", "h100"])
def test_flash_attention_efficiency_and_s2(dev):
    def sdpa(s, b=4, h=16, d=128):
        q = T(b, h, s, d)
        return node_time(aten._scaled_dot_product_flash_attention.default, [q, q, q], [q],
                         (q, q, q, 0.0, True), {}, dev, "bf16")
    f1, b1 = sdpa(4096)
    f2, b2 = sdpa(8192)
    # s^2 work, at the efficiency of each length: e * S / (S + S0) (S0 = 0: the same)
    (fe, be), (fs0, bs0) = dev.attention_efficiency, dev.attention_half_seq

    def at(e, s0, s):
        return e * s / (s + s0)
    assert f2 / f1 == pytest.approx(4.0 * at(fe, fs0, 4096) / at(fe, fs0, 8192), rel=0.02)
    assert b2 / b1 == pytest.approx(4.0 * at(be, bs0, 4096) / at(be, bs0, 8192), rel=0.02)
    flops = 4 * 4 * 16 * 8192**2 * 128 / 2     # causal: half of 4 b h s^2 d
    assert flops / f2 / dev.peak_flops["bf16"] == pytest.approx(at(fe, fs0, 8192), rel=0.01)
    assert 2.5 * flops / b2 / dev.peak_flops["bf16"] == pytest.approx(at(be, bs0, 8192), rel=0.01)
    assert be < fe < dev.max_efficiency


def test_h100_attention_against_its_measurement():
    """The H100's fused attention, as priced, against what one H100 measured (torch's default
    SDPA backend, causal bf16: ``benchmarks/gpu_check.py``'s attention_backends section, the
    committed report): within 10% forward and backward at every timed shape of 2k tokens or
    more (shorter ones are launch-bound; the fill and launch terms price those)."""
    import json
    from pathlib import Path
    report = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu_check_nvidia-h100-80gb-hbm3.json"
    rows = json.loads(report.read_text())["sections"]["attention_backends"]["shapes"]
    checked = 0
    for r in rows:
        b, h, s, d = r["shape"]
        m = r["backends"]["default"]
        if s < 2048 or "fwd_s" not in m:
            continue
        q = T(b, h, s, d)
        f, bw = node_time(aten._scaled_dot_product_flash_attention.default, [q, q, q], [q],
                          (q, q, q, 0.0, True), {}, H100_80GB, "bf16")
        assert f / m["fwd_s"] == pytest.approx(1.0, rel=0.10), (r["shape"], f, m["fwd_s"])
        assert bw / m["bwd_s"] == pytest.approx(1.0, rel=0.10), (r["shape"], bw, m["bwd_s"])
        checked += 1
    assert checked >= 4


@pytest.mark.parametrize("report,dev", [
    ("gpu_check_nvidia-h100-80gb-hbm3", H100_80GB),
    ("gpu_check_nvidia-h200_session28", gpus.H200),
    ("gpu_check_nvidia-h200_session34", gpus.H200),
])
def test_hopper_matmuls_against_their_measurement(report, dev):
    """16-bit matmuls as priced on Hopper against what the GPU check measured (its
    plan_shapes section: the free plans' linears and batched matmuls, bf16, forward and
    ``autograd.grad`` of every input), over the shapes priced at 0.4 ms or more forward:
    the forward within 4% at the median (at the 0.79 of peak once priced, 1.04-1.07x:
    ``gpus._HOPPER_GEMM``), and backward's measured / predicted within 4% of forward's at
    the median (at the forward's rate once priced, 1.10-1.13x:
    ``gpus._HOPPER_MATMUL_BACKWARD``)."""
    import json
    import statistics
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / f"{report}.json"
    shapes = json.loads(path.read_text())["sections"]["plan_shapes"]["shapes"]
    ratios, forward = [], []
    for r in shapes:
        if r["family"] != "matmul":
            continue
        ins = [T(*shape, dtype=getattr(torch, dt)) for shape, dt in r["inputs"]]
        if r["op"] == "aten.linear.default":
            op, out = aten.linear.default, T(*ins[0].shape[:-1], ins[1].shape[0], dtype=ins[0].dtype)
        else:
            assert r["op"] == "aten.matmul.default", r["op"]
            op, out = aten.matmul.default, T(*ins[0].shape[:-1], ins[1].shape[-1], dtype=ins[0].dtype)
        f, b = node_time(op, ins, [out], tuple(ins), {}, dev, "bf16")
        if f >= 0.4e-3:
            ratios.append((r["measured_bwd_s"] / b) / (r["measured_fwd_s"] / f))
            forward.append(r["measured_fwd_s"] / f)
    assert len(ratios) >= 20
    assert statistics.median(forward) == pytest.approx(1.0, abs=0.04), sorted(forward)
    assert statistics.median(ratios) == pytest.approx(1.0, abs=0.04), sorted(ratios)
    # an A100 is not measured: its backward runs at the forward's rate
    assert A100_80GB.matmul_backward_efficiency == 1.0 < 1 / dev.matmul_backward_efficiency


# --- collectives ---------------------------------------------------------------------------
def test_bus_bandwidth_rises_with_message_size():
    link = gpus.NVLINK3
    sizes = [2**s for s in range(16, 31, 2)]
    busbw = [2 * 7 / 8 * s / collective_time("all_reduce", s, 8, link) for s in sizes]
    assert busbw == sorted(busbw)
    assert busbw[0] < 0.1 * link.bandwidth           # 64 KiB: latency-bound
    assert busbw[-1] > 0.95 * link.bandwidth         # 1 GiB: the plateau
    half = 2 * 7 / 8 * link.half_bytes / collective_time("all_reduce", link.half_bytes, 8, link)
    # half of the plateau at half_bytes, less the hop latencies' share
    assert 0.25 * link.bandwidth < half < 0.5 * link.bandwidth


def test_collective_bandwidth_by_node_count():
    """An axis inside a node runs at NVLink busbw; across nodes at the NICs' share; more
    ranks in the ring cost more latency steps."""
    cl = parse_cluster("16xdgx-a100")
    intra = axis_link(cl, (16, 8), 1)
    inter_one_nic = axis_link(cl, (16, 8), 0)         # one rank per node: one NIC
    assert intra.bandwidth == gpus.NVLINK3.bandwidth
    assert inter_one_nic.bandwidth == pytest.approx(gpus.IB_8xHDR.bandwidth / 8)
    whole = axis_link(parse_cluster("16xdgx-a100"), (128,), 0)   # every NIC of each node
    assert whole.bandwidth == pytest.approx(min(gpus.IB_8xHDR.bandwidth, gpus.NVLINK3.bandwidth))
    s = 256 * 2**20
    assert collective_time("all_reduce", s, 8, intra) < collective_time("all_reduce", s, 16, inter_one_nic)
    small = 4096
    assert (collective_time("all_reduce", small, 128, whole)
            > collective_time("all_reduce", small, 16, whole))
    # H100 nodes: twice the NIC line rate of A100's HDR
    assert gpus.IB_8xNDR.bandwidth == pytest.approx(2 * gpus.IB_8xHDR.bandwidth)


def test_point_to_point_for_pipeline_stages():
    s = 64 * 2**20
    link = gpus.IB_8xHDR
    t = collective_time("send", s, 2, link)
    assert t == pytest.approx((s + link.half_bytes) / link.bandwidth + link.latency)


def test_data_parallel_reduction_overlaps_backward_except_last_bucket():
    link = axis_link(parse_cluster("4xdgx-a100"), (32,), 0)
    g = grad_sync_time(4e9, 32, link, backward_time=10.0)
    assert g.exposed == pytest.approx(g.total / math.ceil(4e9 / (25 * 2**20)))


# --- optimizer, host, bubbles ------------------------------------------------------------------
def test_optimizer_step_memory_bound_over_master_weights_and_moments():
    t = step.optimizer_step_time(1e9, A100_80GB)
    bw = A100_80GB.mem_bandwidth * A100_80GB.mem_efficiency
    assert t == pytest.approx(28e9 / bw + step.OPTIMIZER_KERNELS * A100_80GB.launch_overhead)
    assert step.optimizer_step_time(1e9, H100_80GB) < t
    assert step.HOST_OVERHEAD_S > 0
    # torch's foreach AdamW: eight passes over fp32 weight, grad and moments, 80 bytes
    foreach = step.optimizer_step_time(1e9, A100_80GB, optimizer="adamw_foreach", mixed=False)
    assert foreach == pytest.approx(80e9 / bw + step.OPTIMIZER_KERNELS * A100_80GB.launch_overhead)


def test_bubble_by_schedule():
    assert step.bubble_fraction("1f1b", 8, 56) == pytest.approx(7 / 63)
    assert step.bubble_fraction("gpipe", 8, 56) == step.bubble_fraction("1f1b", 8, 56)
    assert step.bubble_fraction("interleaved-1f1b", 8, 56, 2) == pytest.approx(7 / 119)
    assert step.bubble_fraction("1f1b", 1, 4) == 0.0


# --- every constant cites its source -------------------------------------------------------------
_ROOT = pathlib.Path(compute.__file__).resolve().parent
_CITES = ("datasheet", "whitepaper", "guide", "paper", "et al.", "nccl", "issue", "#",
          "assumed", "measured", "zero", "megatron", "flashattention", "tuning.cc", "apex",
          "cublas", "readme", "pytorch", "cuda")


def _constants(path):
    """(name, line) of every module-level UPPER_CASE constant bound to a number, a tuple or
    a dict of numbers, or a Device / Link preset."""
    tree = ast.parse(path.read_text())
    out = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id.lstrip("_").isupper():
                    out.append((t.id, node.lineno, node.end_lineno))
    return out


@pytest.mark.parametrize("module", ["gpus.py", "step.py"])
def test_every_gpu_constant_has_a_source_comment(module):
    """Each module-level constant has a comment naming its source within the comment
    block right above it (or on its own lines)."""
    path = _ROOT / module
    lines = path.read_text().splitlines()
    consts = _constants(path)
    in_const = {i for _, a, b in consts for i in range(a - 1, b)}   # 0-based line indices
    missing = []
    for name, start, end in consts:
        if name in ("GB", "Gbit", "DEVICES", "NODES", "NODE_OF_DEVICE"):
            continue   # units and lookup tables
        # the comment block directly above (contiguous comment lines, up to 25) and the
        # constant's own lines
        block = [lines[i] for i in range(start - 1, end)]
        i = start - 2
        while i >= 0 and start - 2 - i < 25 and (lines[i].lstrip().startswith("#")
                                                  or i in in_const):
            block.append(lines[i])
            i -= 1
        comment = "\n".join(ln.split("#", 1)[1] for ln in block if "#" in ln).lower()
        if not comment or not any(c in comment for c in _CITES):
            missing.append(name)
    assert not missing, f"{module}: constants without a cited source: {missing}"

