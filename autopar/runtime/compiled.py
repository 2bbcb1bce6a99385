"""``compile=True``: each rank's programs run through ``torch.compile`` (Inductor: C++ on the
CPU, Triton on a GPU), forward and backward, collectives included.

The per-rank program is an fx graph whose collective nodes call ``autopar.ops.collectives``
(autograd functions). Under compilation their communicator (``ops.comm.DistComm``) issues
torch's functional collectives (``torch.distributed._functional_collectives``), which
Dynamo traces into the graph as ops (``_c10d_functional.all_gather_into_tensor``, ...) that
Inductor may reorder and overlap with compute, each waited on where its result is first
read. The whole program is one graph: ``fullgraph=True``, so anything Dynamo cannot trace
is a :class:`CompileError` naming the program's node, never a silent graph break.

What changes against eager, and why:

- Passes that serve eager execution only are left out: ``passes.fast_bindings`` (ops
  through torch's C bindings, to save Python dispatch Inductor removes anyway) and
  ``passes.prefetch`` (ZeRO-3 gathers issued one consumer early: Inductor's scheduler
  places the functional collectives itself).
- ZeRO-3's regathering in backward (``ops.collectives.RegatheredWeights``, saved-tensor
  hooks keyed by storage, which a traced graph does not have) becomes a recomputation
  policy of the compiled graph: each gathered weight is marked must-recompute
  (``torch.utils.checkpoint``'s selective policy, as torchtitan's SimpleFSDP does:
  ``ops.collectives.all_gather``), so AOTAutograd's partitioner gathers it again in the
  backward graph instead of saving it.
- What reaches Inductor is the same graph on every rank: a rank's choice that would change
  the graph's shape is read from a tensor at run time (``ops.collectives.to_partial``), since
  Inductor orders two different graphs' collectives differently, and ranks that issue one
  group's collectives in different orders wait for each other for ever (issue 43). The code
  Inductor generates for each forward and backward is checked before it first runs: every
  rank of each group issues the same collectives in the same order, else a
  ``CollectiveOrderError`` (``runtime.collective_order``).
- Collectives inside the compiled graph are limited by the process group's timeout
  (``parallelize(timeout=)`` sets it when autopar creates the group), not by the
  per-collective wait of eager ``DistComm``.

Compilation happens on the first call of each program (and of its backward): the first
``train_step`` reports how long it took (``ParallelModule.compile_report()``, and a line on
rank 0's stderr). Inductor caches what it compiled on disk (``TORCHINDUCTOR_CACHE_DIR``, by
default under the system's temporary directory), keyed by the graph: a second run of the
same plan on the same machine loads it (``cache_hits`` in :func:`compile_report`).
"""
from __future__ import annotations

import re
import time

import torch
from torch._dynamo.utils import counters
from torch.fx import GraphModule
from torch.torch_version import TorchVersion

from autopar.device import records_cuda_graphs
from autopar.errors import ArgumentError, AutoparInputError
from autopar.ops.comm import DistComm
from autopar.options import CUDA_GRAPHS
from autopar.runtime.collective_order import CollectiveOrderError, OrderCheck, checked_backend


INDUCTOR_OPTIONS = {"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all",
                    "bucket_all_reduces_fx": "all"}
"""Inductor's collective bucketing (``torch._inductor.fx_passes.bucketing``): neighbouring
all-gathers (reduce-scatters, all-reduces) of the compiled graph go out as one, as eager
autopar's ZeRO-3 blocks (``passes.prefetch``) and gradient buckets do; one collective per
weight was 2.9x eager ZeRO-3's step on 2 gloo ranks (``benchmarks/runtime_overhead.py
--compile``, the small GPT)."""


def inductor_options(mode: "bool | str", device: torch.device) -> dict:
    """Inductor's options for a program compiled under ``compile=mode`` on ``device``:
    :data:`INDUCTOR_OPTIONS`, and under ``compile="reduce-overhead"`` on a CUDA device
    torch.compile's options of that mode (``torch._inductor.list_mode_options``: Inductor's
    ``triton.cudagraphs``, CUDA graph trees recording each program and replaying it). CUDA
    graphs exist on CUDA devices only: on other devices the options are ``compile=True``'s
    (``cuda_graphs_note`` says so once)."""
    options = dict(INDUCTOR_OPTIONS)
    if mode == CUDA_GRAPHS and records_cuda_graphs(device):
        options.update(torch._inductor.list_mode_options(CUDA_GRAPHS))
    return options


def cuda_graphs_note(mode: "bool | str", device: torch.device) -> str | None:
    """The warning for ``compile="reduce-overhead"`` on a rank that is not a CUDA device
    (its programs run compiled, without CUDA graphs), else None."""
    if mode != CUDA_GRAPHS or records_cuda_graphs(device):
        return None
    return (f"compile={CUDA_GRAPHS!r}: CUDA graphs need CUDA devices and this rank runs on "
            f"{device.type}, so its programs run as under compile=True (no graphs); the plan "
            "was priced with CUDA graphs only where its cluster has GPUs")


class CompileError(AutoparInputError):
    """A per-rank program ``torch.compile`` cannot compile as one graph: the message names
    the program's node, its op and Dynamo's reason, and the way out (``compile=False``)."""


class CompiledProgram:
    """``gm`` compiled with ``torch.compile(fullgraph=True)``, called like ``gm``; compiled
    on the first call. ``which`` names the program in errors ("train", "forward", "stage 1
    train", ...)."""

    def __init__(self, gm: torch.nn.Module, which: str, check: OrderCheck | None = None,
                 options: dict | None = None):
        self.gm, self.which = gm, which
        # ``check``: the ranks compare the collectives Inductor's code issues before it first
        # runs (``runtime.collective_order``); None: Inductor alone. ``options``: Inductor's
        # (``inductor_options``; default ``INDUCTOR_OPTIONS``)
        self._compiled = torch.compile(gm, fullgraph=True, dynamic=False, backend=checked_backend(
            which, check, INDUCTOR_OPTIONS if options is None else options))
        self.compile_s: float | None = None

    @property
    def code(self) -> str:
        return self.gm.code

    def __call__(self, *args, **kwargs):
        if self.compile_s is not None:
            return self._compiled(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            out = self._compiled(*args, **kwargs)
        except torch._dynamo.exc.Unsupported as e:
            raise CompileError(graph_break_message(self.gm, self.which, e)) from e
        except torch._dynamo.exc.BackendCompilerFailed as e:
            # the ranks' generated code would issue collectives in different orders: refused
            # (runtime.collective_order), with its own message rather than Dynamo's wrapping
            if isinstance(e.inner_exception, CollectiveOrderError):
                raise e.inner_exception from e
            raise
        self.compile_s = time.perf_counter() - t0
        return out


class CompiledStage(torch.nn.Module):
    """A pipeline stage's program (``gm``, or its ``AutocastStage``) compiled, as the module
    ``torch.distributed.pipelining`` runs: parameters and buffers stay ``gm``'s."""

    def __init__(self, gm: torch.nn.Module, which: str, check: OrderCheck | None = None,
                 options: dict | None = None):
        super().__init__()
        self.gm = gm
        self.program = CompiledProgram(gm, which, check, options)

    @property
    def code(self) -> str:
        return self.gm.code

    def forward(self, *args):
        return self.program(*args)


COMPILE_FROM_TORCH = (2, 11)
"""The oldest torch ``compile=True`` runs on: checked equal to one device on 2.11, 2.13 and
2.15 (``tests/test_compile.py``; 2.12 not run). Torch 2.11's Dynamo lost the gradient of an
autograd function whose output is also one of its forward's intermediates (the
tensor-parallel GPT's ``c_attn.weight`` came out wrong): autopar's collectives give theirs a
tensor of their own there (``ops.collectives.OWN_OUTPUTS``). Older torch is not checked."""


def check_compilable(comm, version: str = torch.__version__) -> None:
    """``compile=True`` runs on torch.distributed ranks, on torch >= COMPILE_FROM_TORCH: an
    ArgumentError for a communicator of thread ranks (tests' simulated ranks, whose
    exchanges Dynamo cannot trace) or an older torch."""
    if TorchVersion(version) < COMPILE_FROM_TORCH:
        raise ArgumentError(f"compile=True needs torch >= {'.'.join(map(str, COMPILE_FROM_TORCH))} "
                            f"(this is {version}, not checked): upgrade torch, or drop "
                            "compile=True to run eagerly")
    if not isinstance(comm, DistComm):
        raise ArgumentError(f"compile=True runs on torch.distributed ranks (torchrun), not on "
                            f"{type(comm).__name__}: drop compile=True to run on simulated ranks")


_USER_LINE = re.compile(r'File "<eval_with_key>[^"]*", line \d+, in forward\n\s*(\w+) = ')


def graph_break_message(gm: GraphModule, which: str, e: BaseException) -> str:
    """Which node of ``gm`` Dynamo stopped at (the first line of the generated program in
    its traceback: ``name = op(...)``), with its op and Dynamo's reason."""
    text = str(e)
    reason = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    while not isinstance(gm, GraphModule) and isinstance(getattr(gm, "gm", None), torch.nn.Module):
        gm = gm.gm          # an AutocastStage: its program
    names = {n.name: n for n in gm.graph.nodes} if isinstance(gm, GraphModule) else {}
    found = next((m.group(1) for m in _USER_LINE.finditer(text) if m.group(1) in names), None)
    where = "a node of the program"
    if found is not None:
        node = names[found]
        where = f"node {found!r} ({getattr(node.target, '__name__', node.target)})"
    return (f"compile=True: torch.compile cannot compile {where} of this rank's {which} program "
            f"as one graph (a graph break): {reason}. Run this plan without compile=True, or "
            "report the op so that autopar traces it")


def cache_counts() -> tuple[int, int]:
    """Inductor's on-disk cache (hits, misses) in this process so far."""
    return (int(counters["inductor"].get("fxgraph_cache_hit", 0)),
            int(counters["inductor"].get("fxgraph_cache_miss", 0)))


def compile_report(programs, since: tuple[int, int] = (0, 0)) -> dict:
    """Seconds each compiled program took to compile on its first call (with that call),
    and Inductor's on-disk cache hits and misses since ``since`` (:func:`cache_counts`)."""
    hits, misses = cache_counts()
    return {"compile_s": {p.which: p.compile_s for p in programs if p.compile_s is not None},
            "cache_hits": hits - since[0], "cache_misses": misses - since[1]}
