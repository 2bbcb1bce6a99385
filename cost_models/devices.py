"""What the cost models price against: a :class:`Device`, the :class:`Link` between devices
and a :class:`Cluster` of identical devices (``nodes x devices_per_node``).

The presets live in ``gpus.py`` (datasheet GPUs and DGX nodes) and ``cpu.py`` (this machine,
measured); ``hardware.parse_cluster`` builds a cluster from a preset string.
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPE_KEYS = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class Device:
    """One accelerator (or one rank's share of a CPU)."""
    name: str
    memory_bytes: float
    """Device memory in bytes."""
    peak_flops: dict[str, float]
    """Dense FLOP/s by compute dtype: "fp32" (vector units), "tf32", "bf16", "fp16"
    (tensor cores on GPUs), "fp8" (e4m3/e5m2 tensor cores: Hopper; absent where the device
    has none, and ``precision="fp8"`` is refused there). Datasheet peaks for GPUs; measured
    for the CPU (its fp8: ``torch._scaled_mm``, converted in software)."""
    mem_bandwidth: float
    """Memory bandwidth in bytes/s (datasheet for GPUs; measured copy for the CPU)."""
    max_efficiency: float = 1.0
    """Fraction of ``peak_flops`` a large GEMM reaches (published cuBLAS numbers; 1.0 for a
    measured peak, which already is an achieved rate)."""
    mem_efficiency: float = 1.0
    """Fraction of ``mem_bandwidth`` a large streaming kernel reaches."""
    fill_time: float = 0.0
    """Seconds of pipeline fill / tail (wave quantization) per compute kernel: an op of
    ``peak * max_efficiency * fill_time`` FLOPs runs at half of ``max_efficiency``."""
    launch_overhead: float = 0.0
    """Seconds of fixed cost per kernel (launch and framework dispatch)."""
    pipeline_action: float = 0.0
    """Seconds the pipeline runtime adds per scheduled action of a stage (a forward, a
    backward, or zero bubble's input and weight halves): torch.distributed.pipelining's
    bookkeeping, the stage program's call and its point-to-point messages. Measured for CPU
    ranks (``benchmarks/pipeline_overhead.py``); zero for GPUs, whose host runs ahead."""
    sms: int = 0
    """Streaming multiprocessors: a GEMM's output tiles run in waves of ``sms`` tiles
    (wave quantization). 0 = not modelled (the CPU)."""
    gemm_tile: tuple[int, int] = (0, 0)
    """(rows, cols) of the output tile one SM computes in a large cuBLAS GEMM."""
    matmul_backward_efficiency: float = 1.0
    """The rate a matmul's backward GEMMs (grad-input, grad-weight) reach, as a fraction of the
    forward GEMM's at the same wave quantization (``gpus._HOPPER_MATMUL_BACKWARD``, measured
    in bf16, taken for fp8 too). 1.0: the forward's rate (not measured on the device)."""
    attention_efficiency: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) fraction of the 16-bit peak a fused (flash) attention kernel
    reaches; (0, 0) = priced as any matmul-like op at ``max_efficiency``."""
    context_attention_efficiency: tuple[float, float] | None = None
    """(forward, backward) fraction of the 16-bit peak context-parallel attention reaches:
    its piece pairs, each a fused kernel call, and their merges by log-sum-exp
    (``autopar.ops.context_attention``), as measured; None: ``attention_efficiency``."""
    attention_half_seq: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) query length S0 at which fused attention reaches half of
    ``attention_efficiency``: at query length S it runs at ``efficiency * S / (S + S0)``
    (the per-row softmax bookkeeping and the causal mask's diagonal blocks weigh more on a
    short sequence). (0, 0): the efficiency at every length."""
    view_overhead: float = 0.0
    """Seconds per view op (a reshape, transpose, ...: framework dispatch and autograd
    bookkeeping, no kernel), forward and backward alike. Zero for GPUs, whose host runs
    ahead of the kernels; the CPU's host IS the device, so every view is on its clock."""
    host_op_s: float = 0.0
    """Host seconds per ATen call of an eager step (Python, dispatcher, autograd engine,
    launch), run ahead of the device: the step is ``max(device, host)``
    (``cost_models.host``, ``cost_models.step.step_time``). GPUs: ``host.GPU_HOST_OP_S``;
    0 for CPU ranks, whose host is the device (``launch_overhead`` / ``view_overhead``)."""
    p2p_by_tag: bool = True
    """Whether the ranks' backend matches point-to-point messages by tag (gloo, on CPU
    ranks), so that two host threads may exchange messages between the same ranks at once;
    NCCL (GPUs: False) matches them by the order they were issued in
    (``autopar.device.p2p_matched_by_tag``, which the runtime reads: DualPipeV's pairs run at
    once only where their skip values may be sent so, ``runtime.overlap``)."""

    def __hash__(self) -> int:  # peak_flops is a dict; hash by name and sizes
        return hash((self.name, self.memory_bytes, self.mem_bandwidth))


@dataclass(frozen=True)
class Link:
    """One communication link class."""
    bandwidth: float
    """Bytes/s per direction that a collective achieves (nccl-tests "busbw")."""
    latency: float
    """Seconds per ring step (alpha)."""
    collectives: tuple[tuple[str, float, float], ...] = ()
    """``(collective, latency, bandwidth)`` for collectives whose implementation reaches a
    different alpha or bus bandwidth on this link than ``latency`` / ``bandwidth`` (gloo's
    all_gather and reduce_scatter are several times slower than its all_reduce)."""
    half_bytes: float = 0.0
    """Message size (bytes per rank) at which a collective reaches half of ``bandwidth``:
    bus bandwidth grows with size as ``bandwidth * S / (S + half_bytes)`` (nccl-tests
    curves). 0 = flat (the measured gloo links, whose alpha already holds it)."""
    skew: float = 0.0
    """Seconds a collective between computations waits for its last peer beyond the ring's
    latency (ranks leave their computation unevenly), once per collective. Zero where the
    devices run a stream each (GPUs: the host runs ahead and kernels queue); measured for
    CPU ranks, whose collective starts when the rank's own compute ends."""


@dataclass(frozen=True)
class Cluster:
    """``nodes x devices_per_node`` identical devices."""
    name: str
    nodes: int
    devices_per_node: int
    device: Device
    intra: Link
    """Link between devices of one node (NVLink; memory for CPU ranks)."""
    inter: Link
    """Link between nodes; ``bandwidth`` is per node (all its NICs together)."""

    def __post_init__(self):
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ValueError(f"cluster {self.name!r}: nodes ({self.nodes}) and "
                             f"devices_per_node ({self.devices_per_node}) must be >= 1")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node
