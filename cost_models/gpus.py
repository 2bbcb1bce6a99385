"""Datasheet GPUs and the DGX nodes that hold them: devices, NVLink and InfiniBand links.

Every constant cites its source. Bandwidths are what a collective achieves (nccl-tests
"busbw"), not line rates; nothing here is fitted to end-to-end training results.
"""
from __future__ import annotations

from dataclasses import dataclass

from .devices import Device, Link
from .host import GPU_HOST_OP_S

GB = 1e9
Gbit = 1e9 / 8

# --- GPUs --------------------------------------------------------------------------------
# Peaks are dense (no 2:4 sparsity). Large-GEMM efficiencies:
#   A100: cuBLAS fp16 GEMMs of several thousand per side reach ~250 of 312 TFLOP/s, i.e.
#         ~80% (NVIDIA "Matrix Multiplication Background User's Guide", DU-09799-001, its
#         GEMM-throughput-vs-size plots; the exact figure number is not pinned here).
#   Hopper (H100, H200, H800): measured, 0.75 (``_HOPPER_GEMM``). The GPU check's plan_shapes
#         section (bf16 linears and batched matmuls of the free plans, CUDA events, median of
#         10; the reports below ``_HOPPER_MATMUL_BACKWARD``) timed the 27 shapes priced at
#         0.4 ms or more at a median 1.054x the forward priced at 0.79 on the H100 and 1.037x
#         / 1.071x on the H200; 1.056x over the 81: 0.79 / 1.056 = 0.75. The 0.79 it
#         replaces was a tuned square mm's best, 780 of 989 TFLOP/s (gist
#         Chillee/2ec89696db8b7ed1c24461159e325405, "H100 peak matmul FLOPS"), not what the
#         plans' own shapes reach through ``torch.nn.functional.linear``. Taken for fp8's
#         GEMMs too (the one efficiency a device has; fp8 not timed without its casts).
# fill_time 3 us: a GEMM needs whole waves of output tiles over 108 / 132 SMs (same guide,
#   "Wave Quantization"); ~3 us of fill and tail per kernel is the scale of one tile's
#   main loop, so an op of peak*3us FLOPs runs at half efficiency.
# launch_overhead 5 us: CUDA kernel launch plus PyTorch eager dispatch per op (the few-us
#   launch latency in the CUDA C++ Best Practices Guide, "Asynchronous Transfers"; the
#   PyTorch per-op CPU overhead is of the same order).
# Achieved HBM bandwidth ~90% of datasheet (BabelStream / STREAM triad on A100 and H100).
_GPU_FILL = 3e-6
_GPU_LAUNCH = 5e-6
_GPU_MEM_EFF = 0.9
_HOPPER_GEMM = 0.75
# Wave quantization: a cuBLAS GEMM computes its output in 256 x 128 tiles, one per SM at a
#   time, so it runs ceil(tiles / SMs) waves and the last one may be mostly empty (NVIDIA
#   "Matrix Multiplication Background User's Guide", "Wave Quantization": "in the particular
#   case of 256x128 thread block tiles, it can execute one thread block per SM, leading to a
#   wave size of 108 tiles" on A100).
_GEMM_TILE = (256, 128)
# SMs: A100 SXM 108 (NVIDIA A100 Tensor Core GPU Architecture whitepaper, Table 3);
#   H100 SXM5 132 (NVIDIA H100 Tensor Core GPU Architecture whitepaper, Table 2).
_A100_SMS = 108
_H100_SMS = 132
# Fused (flash) attention, causal, head dim 128, sequence 2k-16k, fraction of the 16-bit
#   dense peak (read off the papers' benchmark figures):
#   A100: FlashAttention-2 (Dao 2023, Fig. 4-6) forward ~190-200 of 312 TFLOP/s (0.62),
#         backward ~165-175 (0.54); the paper's abstract: "50-73% of the theoretical maximum".
#   H100: measured (benchmarks/gpu_check.py's attention_backends section, one H100 80GB
#         HBM3, torch 2.11, 2026-11-27: benchmarks/results/gpu_check_nvidia-h100-80gb-hbm3.json):
#         torch's default SDPA backend there is cuDNN's fused attention, at 0.58-0.65 of the
#         bf16 peak forward and 0.50-0.52 backward at 8k-16k tokens, 0.46 / 0.33 at 2k
#         (FlashAttention-2, its flash backend, 0.27-0.34 / 0.19-0.31: what this constant
#         held before, from Dao 2023, Sec. 4.1: "up to 335 TFLOPs/s"). Fitted (least squares
#         in relative error over 2k-16k, 32-64 heads of 128) as e * S / (S + S0):
#         forward e 0.68, S0 1,050; backward e 0.59, S0 1,550 (within 7% of each point).
# Context-parallel attention on Hopper (``Device.context_attention_efficiency``): its piece
#   pairs through cuDNN's fused kernel with the merges, causal, bf16, grouped-query 32/8 heads
#   of 128, one H200, torch 2.11 (benchmarks/gpu_context_block.py, 2026-11-28:
#   benchmarks/results/gpu_context_block_cudnn_session20.json): 191 / 241 TFLOP/s forward /
#   backward at 8k tokens, 296 / 354 at 16k, of the 989.5 peak; the 16k figures (a ring's
#   blocks are longer still at the lengths it is used for). Through the flash kernel they
#   were 150 / 171 and 221 / 229 (..._fused_session20.json), as plain matmuls 12 / 19
#   (..._matmul_session20.json).
_HOPPER_CONTEXT = (0.30, 0.36)
# Backward matmuls on Hopper (``Device.matmul_backward_efficiency``): the GPU check's
#   plan_shapes section times the free plans' GEMMs forward and backward (bf16, CUDA events,
#   3 warm-up then the median of 10; backward = torch.autograd.grad of every input) against
#   ``compute.node_time``. On the 27 linears and batched matmuls priced at 0.4 ms or more
#   forward, backward measured / predicted over forward measured / predicted has median
#   1.098 on an H100 80GB HBM3 (2026-11-27: gpu_check_nvidia-h100-80gb-hbm3.json), 1.131
#   and 1.114 on an H200 (2026-11-29 and 11-30: gpu_check_nvidia-h200_session28.json,
#   _session34.json); 1.115 over the 81 (0.98-1.40; 1.085-1.124 over the 14 of 1 ms and
#   more): the backward GEMMs reach 1 / 1.115 = 0.90 of the forward's rate, where the model
#   had priced them at the forward's (a ratio to the forward's own miss, so it holds beside
#   ``_HOPPER_GEMM``). Not measured on an A100 (1.0 there). Taken for fp8's GEMMs too, which
#   the check times only with their eager casts: their backward runs on transposed copies
#   as well, and under torchao's rowwise recipe without fast accumulation, slower still
#   (``cost_models.fp8``); at the forward's rate, fp8 rowwise under TP 8 was priced faster
#   than bf16 where torchtitan measured it 15% slower (``benchmarks/ranking.py``, tt-atp-8b).
_HOPPER_MATMUL_BACKWARD = 0.90
_A100_ATTENTION = (0.62, 0.54)
_H100_ATTENTION = (0.68, 0.59)
_H100_ATTENTION_HALF_SEQ = (1050.0, 1550.0)

A100_80GB = Device(
    name="A100-80GB-SXM",
    memory_bytes=80 * 2**30,
    # NVIDIA A100 Tensor Core GPU datasheet (SXM): FP32 19.5, TF32 156, BF16/FP16 312 TFLOPS.
    peak_flops={"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    mem_bandwidth=2039 * GB,  # datasheet: HBM2e 2,039 GB/s
    max_efficiency=0.8, mem_efficiency=_GPU_MEM_EFF,
    fill_time=_GPU_FILL, launch_overhead=_GPU_LAUNCH, host_op_s=GPU_HOST_OP_S, p2p_by_tag=False,
    sms=_A100_SMS, gemm_tile=_GEMM_TILE, attention_efficiency=_A100_ATTENTION,
)

H100_80GB = Device(
    name="H100-80GB-SXM",
    memory_bytes=80 * 2**30,
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): FP32 67, TF32 494.5, BF16/FP16 989.5
    # TFLOPS dense (the datasheet's 989 / 1,979 are with sparsity); FP8 1,979 TFLOPS dense
    # (the datasheet's 3,958 is with sparsity). The A100 datasheet lists no FP8.
    peak_flops={"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12,
                "fp8": 1979e12},
    mem_bandwidth=3350 * GB,  # datasheet: HBM3 3.35 TB/s
    max_efficiency=_HOPPER_GEMM, mem_efficiency=_GPU_MEM_EFF,
    fill_time=_GPU_FILL, launch_overhead=_GPU_LAUNCH, host_op_s=GPU_HOST_OP_S, p2p_by_tag=False,
    sms=_H100_SMS, gemm_tile=_GEMM_TILE, attention_efficiency=_H100_ATTENTION,
    attention_half_seq=_H100_ATTENTION_HALF_SEQ, context_attention_efficiency=_HOPPER_CONTEXT,
    matmul_backward_efficiency=_HOPPER_MATMUL_BACKWARD,
)

H200 = Device(
    name="H200-141GB-SXM",
    memory_bytes=141 * GB,  # NVIDIA H200 datasheet: 141 GB HBM3e
    # Same compute as H100 SXM (H200 datasheet lists identical Tensor Core peaks).
    peak_flops=dict(H100_80GB.peak_flops),
    mem_bandwidth=4800 * GB,  # datasheet: 4.8 TB/s
    max_efficiency=_HOPPER_GEMM, mem_efficiency=_GPU_MEM_EFF,
    fill_time=_GPU_FILL, launch_overhead=_GPU_LAUNCH, host_op_s=GPU_HOST_OP_S, p2p_by_tag=False,
    sms=_H100_SMS, gemm_tile=_GEMM_TILE, attention_efficiency=_H100_ATTENTION,
    attention_half_seq=_H100_ATTENTION_HALF_SEQ, context_attention_efficiency=_HOPPER_CONTEXT,
    matmul_backward_efficiency=_HOPPER_MATMUL_BACKWARD,
)

# H800 SXM, the export variant of H100 SXM: the same Hopper die, Tensor Core peaks and HBM3
# (NVIDIA H800 datasheet / product brief), with NVLink cut to 400 GB/s bidirectional
# (NVLINK_H800 below); the DeepSeek-V3 report trains on it (DeepSeek-AI 2024,
# arXiv:2412.19437, Sec. 3.1).
H800 = Device(
    name="H800-80GB-SXM",
    memory_bytes=80 * 2**30,
    peak_flops=dict(H100_80GB.peak_flops),
    mem_bandwidth=3350 * GB,
    max_efficiency=_HOPPER_GEMM, mem_efficiency=_GPU_MEM_EFF,
    fill_time=_GPU_FILL, launch_overhead=_GPU_LAUNCH, host_op_s=GPU_HOST_OP_S, p2p_by_tag=False,
    sms=_H100_SMS, gemm_tile=_GEMM_TILE, attention_efficiency=_H100_ATTENTION,
    attention_half_seq=_H100_ATTENTION_HALF_SEQ, context_attention_efficiency=_HOPPER_CONTEXT,
    matmul_backward_efficiency=_HOPPER_MATMUL_BACKWARD,
)

DEVICES: dict[str, Device] = {"a100": A100_80GB, "h100": H100_80GB, "h200": H200, "h800": H800}

# --- Links -------------------------------------------------------------------------------
# NVLink busbw: line rate minus NCCL's ~20% protocol overhead ("450GB/s is the line rate.
#   With the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of
#   370GB/s", S. Jeaugey, nccl-tests#212). A100: 300 GB/s line rate -> 240 GB/s (8x A100
#   SXM measure 200-230 GB/s all_reduce busbw, nccl-tests#149, #178).
# InfiniBand busbw: 90% of the node's NIC line rate (nccl-tests#119: 85-96 of 100 GB/s).
# Latency: NCCL's per-hop ring latency for the LL128 protocol, 2.5 us on NVLink and on the
#   network (nccl src/graph/tuning.cc, hwLat table).
_NCCL_NVLINK_EFF = 370 / 450
_IB_EFF = 0.9
_HOP_LATENCY = 2.5e-6
# Bus bandwidth by message size S: busbw(S) = plateau * S / (S + half_bytes), i.e. the
#   size costs ``factor * half_bytes / plateau`` of fixed time per collective on top of the
#   hop latency. nccl-tests all_reduce_perf curves on DGX A100 / H100 are latency-bound
#   below ~1 MB and at the plateau above ~256 MB (nccl-tests README / PERFORMANCE.md define
#   busbw; the issues cited above show full curves). The half points (4 MB on NVLink, 8 MB
#   across InfiniBand) are ASSUMED from that shape, not read from one published table.
_NVLINK_HALF = 4 * 2**20
_IB_HALF = 8 * 2**20

# line rates: NVIDIA DGX A100 / DGX H100 datasheets (NVLink3 300 GB/s, NVLink4 450 GB/s per
# GPU and direction; 8 x 200 Gb/s HDR, 8 x 400 Gb/s NDR InfiniBand NICs)
NVLINK3 = Link(bandwidth=300 * GB * _NCCL_NVLINK_EFF, latency=_HOP_LATENCY,  # DGX A100
               half_bytes=_NVLINK_HALF)
NVLINK4 = Link(bandwidth=450 * GB * _NCCL_NVLINK_EFF, latency=_HOP_LATENCY,  # DGX H100/H200
               half_bytes=_NVLINK_HALF)
# H800: NVLink 400 GB/s bidirectional (H800 product brief), 200 GB/s a direction; at NCCL's
#   efficiency above that is 164 GB/s, as DeepSeek-V3's report measures it: "NVLink offers a
#   bandwidth of 160 GB/s, roughly 3.2 times that of IB (50 GB/s)" (arXiv:2412.19437,
#   Sec. 3.2.2); its IB, 50 GB/s a GPU, is one 400 Gb/s NDR NIC a GPU (IB_8xNDR).
NVLINK_H800 = Link(bandwidth=200 * GB * _NCCL_NVLINK_EFF, latency=_HOP_LATENCY,
                   half_bytes=_NVLINK_HALF)
IB_8xHDR = Link(bandwidth=8 * 200 * Gbit * _IB_EFF, latency=_HOP_LATENCY,    # 8 x 200 Gb/s
                half_bytes=_IB_HALF)
IB_8xNDR = Link(bandwidth=8 * 400 * Gbit * _IB_EFF, latency=_HOP_LATENCY,    # 8 x 400 Gb/s
                half_bytes=_IB_HALF)


@dataclass(frozen=True)
class NodePreset:
    device: Device
    devices_per_node: int
    intra: Link
    inter: Link


NODES: dict[str, NodePreset] = {
    # DGX A100: 8 A100 SXM, NVLink3 300 GB/s per direction, 8 x 200 Gb/s HDR InfiniBand.
    "dgx-a100": NodePreset(A100_80GB, 8, NVLINK3, IB_8xHDR),
    # DGX H100: 8 H100 SXM, NVLink4 450 GB/s per direction, 8 x 400 Gb/s NDR InfiniBand.
    "dgx-h100": NodePreset(H100_80GB, 8, NVLINK4, IB_8xNDR),
    # DGX H200: same fabric as DGX H100.
    "dgx-h200": NodePreset(H200, 8, NVLINK4, IB_8xNDR),
    # H800 nodes as DeepSeek-V3 trained on them: 8 H800 on NVLink/NVSwitch (200 GB/s per
    # direction), 8 x 400 Gb/s InfiniBand (arXiv:2412.19437, Sec. 3.1 and 3.2.2).
    "dgx-h800": NodePreset(H800, 8, NVLINK_H800, IB_8xNDR),
}
NODE_OF_DEVICE = {"a100": "dgx-a100", "h100": "dgx-h100", "h200": "dgx-h200", "h800": "dgx-h800"}
