"""Cost models: what an op, a collective and the training state cost on a cluster.

- :mod:`.hardware`  clusters from presets (``parse_cluster("4x8xH100")``), mesh axis links
- :mod:`.devices`   the Device, Link and Cluster types
- :mod:`.gpus`      datasheet GPUs and DGX nodes;  :mod:`.cpu`  this machine, measured
- :mod:`.compute`   FLOPs, bytes and roofline time of one ATen op
- :mod:`.comm`      alpha-beta time of collectives; overlap of gradient sync with backward
- :mod:`.memory`    parameters, gradients and optimizer states by precision and ZeRO stage

Nothing here imports the solver, the passes or the runtime.
"""
from .comm import GradSync, collective_time, grad_sync_time
from .compute import bytes_moved, flops, node_time
from .cpu import cpu_device
from .devices import Cluster, Device, Link
from .hardware import axis_link, parse_cluster
from .memory import allocator_overhead, training_state_bytes

__all__ = [
    "Cluster", "Device", "GradSync", "Link", "allocator_overhead", "axis_link",
    "bytes_moved", "collective_time", "cpu_device", "flops", "grad_sync_time", "node_time",
    "parse_cluster", "training_state_bytes",
]
