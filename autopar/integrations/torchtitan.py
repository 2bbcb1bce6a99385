"""torchtitan's own trainer with its model run by ``autopar.parallelize``.

torchtitan (0.3) builds a model from a ``ModelSpec`` whose ``parallelize_fn`` applies the
parallelism; :func:`model_spec` returns the spec with autopar's in its place::

    from torchtitan.models.llama3 import model_registry
    from autopar.integrations import torchtitan as titan

    config.model_spec = titan.model_spec(model_registry("debugmodel"), data=2)  # autopar pins
    trainer = config.build(); trainer.train()            # torchtitan's Trainer, data, loss

under ``torchrun``. On a machine without an accelerator call :func:`use_cpu` first
(torchtitan 0.3 has no CPU setting: below).

What torchtitan's trainer is given, and why:

- **The model.** ``parallelize_fn`` gets the model on the meta device and returns
  :class:`AutoparModel` around it. The trainer then calls ``to_empty`` and ``init_weights``
  on it: the whole model is materialized and initialized by torchtitan's own
  ``init_weights`` (the trainer seeds every rank alike, so each rank holds one device's
  weights), and only then ``autopar.parallelize`` plans it for the global batch
  (``training.local_batch_size`` x the data-parallel degree of torchtitan's mesh, by
  ``training.seq_len``; token ids and RoPE positions) and keeps each rank's shards. From
  then on ``parameters()`` are those shards: torchtitan's optimizer is built over them.
- **The data.** torchtitan's loader is kept: each rank of its batch mesh reads its own
  rows. :meth:`AutoparModel.forward` all-gathers the ranks' rows (rank order) into the
  global batch and runs ``pm`` on it (``batch="global"``: every plan takes its own part,
  whatever its data degree), then returns this rank's rows of the logits.
- **The loss.** torchtitan's loss is a rank's *sum* over its tokens divided by the global
  number of tokens; one device's loss is the sum of the ranks' terms. The rows' backward
  (:class:`_BatchRows`) all-gathers every rank's gradient of its own rows, so each rank
  hands ``pm`` the gradient of that whole sum (the same on every rank), which is what
  ``pm``'s backward expects: the gradients equal one device's (a sum, not DDP's mean).
- **Accumulation.** With ``training.global_batch_size`` over ``local_batch_size`` x the
  data ranks, the trainer runs that many forward and backward passes a step, each loss
  over the step's global token count; all but the step's last run under ``pm.no_sync()``
  (their gradients stay local), so the ranks' gradients are summed once (DDP's way).
- **Gradient clipping.** The trainer clips with ``torchtitan.distributed.utils.
  clip_grad_norm_`` by the norm of the local gradients. :func:`_clip_grad_norm_` takes its
  place (module attribute, set by :func:`parallelize_fn`): for an :class:`AutoparModel`'s
  parameters it clips by the norm of the whole gradient across shards
  (:func:`autopar.integrations.grad_norm.global_grad_norm`, one all-reduce), as
  ``torch.nn.utils.clip_grad_norm_`` does on one device; any other parameters go to
  torchtitan's own function unchanged.

Refused with an ``autopar.ArgumentError`` that names the fix: torchtitan's own tensor,
pipeline, context or expert parallel degrees > 1 (autopar's pins choose those),
``compile.enable`` on the model, ``ChunkedLossWrapper`` (it takes the model's ``lm_head``
out of the model: use ``CrossEntropyLoss.Config``), attention masks (flex/varlen inner
attention: give the layers ``ScaledDotProductAttention.Config()``, which ``autopar``
captures; torchtitan's own graph trainer tests use it), a pipelined plan (its schedule runs
forward and backward together; torchtitan's ``loss.backward()`` cannot drive it).
torchtitan's activation checkpointing config is not applied: autopar plans recomputation
itself (``recompute=`` pins). Not handled yet: torchtitan's checkpointer (``checkpoint.enable``)
and validator on an :class:`AutoparModel`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import types
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d

try:
    import torchtitan.tools.utils as titan_utils     # first: use_cpu patches its names
    import torchtitan.distributed.utils as titan_dist
except ImportError as e:        # pragma: no cover - the integration needs its framework
    raise ImportError("autopar.integrations.torchtitan needs torchtitan 0.3: "
                      "pip install torchtitan==0.3.0") from e

import autopar
from autopar.errors import ArgumentError
from autopar.integrations.grad_norm import global_grad_norm

__all__ = ["AutoparModel", "model_spec", "parallelize_fn", "torch_compat", "use_cpu"]

# torchtitan's modules that copy ``device_type`` / ``device_module`` from
# torchtitan.tools.utils when they are imported (``from torchtitan.tools.utils import ...``)
_DEVICE_READERS = ("torchtitan.components.metrics", "torchtitan.distributed.parallel_dims",
                   "torchtitan.distributed.utils", "torchtitan.models.common.token_dispatcher")


def _cpu_device_module() -> types.SimpleNamespace:
    """What torchtitan calls on ``device_module`` (``torch.cuda`` on a GPU), for the CPU:
    one device, index 0; no caching allocator, so no memory statistics (its memory monitor
    then logs -1 GiB); total memory from ``os.sysconf``."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return types.SimpleNamespace(
        device_count=lambda: 1, set_device=lambda device: None, current_device=lambda: 0,
        synchronize=lambda device=None: None, empty_cache=lambda: None,
        reset_peak_memory_stats=lambda device=None: None, memory_stats=lambda device=None: {},
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(name="cpu", total_memory=total))


def use_cpu() -> None:
    """Run torchtitan 0.3's trainer on CPU ranks (gloo), where it has no setting for it.

    ``torchtitan/tools/utils.py`` fixes the device when it is imported::

        device_type = _get_available_device_type() or "cuda"     # None without an accelerator
        device_module = _get_device_module(device_type)          # torch.cuda

    and the trainer then calls ``device_module.set_device`` (``torch.cuda``: no CUDA in a CPU
    build), builds its memory monitor from ``device_module``'s memory statistics, and picks
    the process group's backend from ``device_type`` (``"cpu"`` -> gloo). This sets
    ``device_type = "cpu"`` and ``device_module`` to :func:`_cpu_device_module`'s stand-in in
    ``torchtitan.tools.utils`` and in the modules that copied the two names on import
    (``_DEVICE_READERS``, where already imported), and calls :func:`torch_compat`. Nothing
    else; call it before building the trainer. A no-op where torchtitan found an accelerator."""
    torch_compat()
    if titan_utils.device_type != "cuda" or torch.cuda.is_available():
        return
    module = _cpu_device_module()
    for name in ("torchtitan.tools.utils",) + _DEVICE_READERS:
        mod = sys.modules.get(name)
        if mod is not None:
            if hasattr(mod, "device_type"):
                mod.device_type = "cpu"
            if hasattr(mod, "device_module"):
                mod.device_module = module


def _set_pg_timeouts(timeout, parallel_dims) -> None:
    """torchtitan 0.3's ``set_pg_timeouts`` (``torchtitan/distributed/utils.py``) with torch's
    ``_set_pg_timeout``, the name ``dist.set_timeout`` has before torch has it public."""
    dist.barrier()
    groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()]
    for group in groups + [None]:
        distributed_c10d._set_pg_timeout(timeout, group)


def torch_compat() -> None:
    """torchtitan 0.3 is written for a newer torch than autopar's 2.13: after its first step the
    trainer calls ``torch.distributed.set_timeout``, which torch 2.13 has as
    ``distributed_c10d._set_pg_timeout``. Where ``dist.set_timeout`` is missing this sets
    ``torchtitan.distributed.utils.set_pg_timeouts`` to :func:`_set_pg_timeouts` (the same
    barrier and timeouts). Nothing else; :func:`use_cpu` and :func:`parallelize_fn` call it."""
    if not hasattr(dist, "set_timeout"):
        titan_dist.set_pg_timeouts = _set_pg_timeouts


# ---- the model -------------------------------------------------------------------------------
class _TokensPositions(nn.Module):
    """``forward(tokens, positions) -> logits``: torchtitan's decoder in the form autopar
    captures (positional tensor inputs)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens, positions):
        return self.model(tokens, positions=positions)


class _BatchRows(torch.autograd.Function):
    """This batch rank's rows of the global batch's output; backward: every rank's gradient
    of its rows, all-gathered in rank order (the gradient of the sum of the ranks' losses)."""

    @staticmethod
    def forward(ctx, out, group, rank: int, world: int):
        ctx.group, ctx.world = group, world
        return out.tensor_split(world, dim=0)[rank].clone()

    @staticmethod
    def backward(ctx, g):
        return _gather_rows(g, ctx.group, ctx.world), None, None, None


def _gather_rows(t: torch.Tensor, group, world: int) -> torch.Tensor:
    """Every batch rank's ``t`` in rank order, concatenated along dim 0."""
    if world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


_MODELS: "weakref.WeakSet[AutoparModel]" = weakref.WeakSet()


class AutoparModel(nn.Module):
    """What :func:`parallelize_fn` returns to torchtitan's trainer: the meta model until
    ``init_weights``, then ``pm`` (``autopar.parallelize``'s module) in its place."""

    def __init__(self, model: nn.Module, *, rows: int, seq_len: int, group, rank: int,
                 world: int, options: dict, accumulate: int = 1):
        super().__init__()
        self.model = model
        self.pm = None
        self.rows, self.seq_len = rows, seq_len
        self.group, self.batch_rank, self.batch_world = group, rank, world
        self.options = dict(options)
        self.accumulate, self.micro = accumulate, 0   # micro-batches a step; forwards so far
        _MODELS.add(self)

    @property
    def lm_head(self):
        raise ArgumentError("torchtitan's ChunkedLossWrapper takes lm_head out of the model; "
                            "autopar runs the whole model: use loss=CrossEntropyLoss.Config(...)")

    def get_attention_masks(self, *args, **kwargs):
        raise ArgumentError("torchtitan builds attention masks for flex/varlen attention, which "
                            "autopar does not capture: give every layer's attention "
                            "inner_attention=ScaledDotProductAttention.Config() (causal)")

    def init_weights(self, buffer_device=None) -> None:
        """torchtitan's ``init_weights`` on the whole model, then ``autopar.parallelize``:
        from here on the module holds this rank's shards only."""
        if self.pm is not None:
            raise ArgumentError("AutoparModel.init_weights after parallelizing: the weights are "
                                "shards now; load them with pm.load_full_state_dict")
        model = self.model
        with torch.no_grad():
            model.init_weights(buffer_device=buffer_device)
        device = next(model.parameters()).device
        tokens = torch.zeros(self.rows, self.seq_len, dtype=torch.long, device=device)
        positions = torch.arange(self.seq_len, device=device).expand(self.rows, -1).contiguous()
        with torch.enable_grad():
            pm = autopar.parallelize(_TokensPositions(model), (tokens, positions), None,
                                     **self.options)
        if pm.plan.pipeline_stages > 1:
            raise ArgumentError(f"a {pm.plan.pipeline_stages}-stage pipeline: its schedule runs "
                                "forward and backward together, which torchtitan's loss.backward() "
                                "cannot drive; pin pipeline=1")
        del self.model                  # the whole model: pm holds this rank's shards
        self.pm = pm
        if dist.get_rank() == 0:
            print(f"autopar: torchtitan's model runs the plan mesh {tuple(pm.plan.mesh_shape)} "
                  f"{tuple(pm.plan.mesh_axes)} on a global batch of {self.rows} x {self.seq_len} "
                  f"tokens ({self.rows // self.batch_world} rows per batch rank x "
                  f"{self.batch_world})", file=sys.stderr, flush=True)

    def forward(self, tokens, positions=None, attention_masks=None):
        if attention_masks is not None:
            self.get_attention_masks()
        if self.pm is None:
            raise ArgumentError("AutoparModel called before init_weights: torchtitan's trainer "
                                "calls to_empty and init_weights first, which parallelize it")
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        tokens = _gather_rows(tokens, self.group, self.batch_world)
        positions = _gather_rows(positions, self.group, self.batch_world)
        if tuple(tokens.shape) != (self.rows, self.seq_len):
            raise ArgumentError(f"a global batch of {list(tokens.shape)} tokens; the plan was made "
                                f"for {[self.rows, self.seq_len]} (training.local_batch_size x the "
                                "batch ranks, training.seq_len)")
        sync = contextlib.nullcontext()
        if torch.is_grad_enabled() and self.accumulate > 1:
            self.micro += 1     # all but a step's last micro-batch: gradients stay local
            if self.micro % self.accumulate:
                sync = self.pm.no_sync()
        with sync:
            out = self.pm(tokens, positions)
        return _BatchRows.apply(out, self.group, self.batch_rank, self.batch_world)


# ---- the parallelize function and gradient clipping -----------------------------------------
_TITAN_CLIP = titan_dist.clip_grad_norm_


def _owner(params: list) -> "AutoparModel | None":
    ids = {id(p) for p in params}
    for m in list(_MODELS):
        if m.pm is not None and ids and ids <= {id(p) for p in m.parameters()}:
            return m
    return None


@torch.no_grad()
def _clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                     error_if_nonfinite: bool = False, foreach=None, pp_mesh=None,
                     ep_enabled: bool = False):
    """``torchtitan.distributed.utils.clip_grad_norm_`` for an :class:`AutoparModel`'s
    parameters: the norm of the whole gradient across shards; others: torchtitan's."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owner = _owner(params)
    if owner is None:
        return _TITAN_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh,
                           ep_enabled)
    if float(norm_type) != 2.0:
        raise ArgumentError(f"gradient clipping by the {norm_type}-norm: autopar's global norm "
                            "is the 2-norm (norm_type=2)")
    norm = global_grad_norm(owner.pm, float(max_norm))
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"the total norm of the gradients is {float(norm)}")
    return norm


def _refuse_titan_parallelism(parallel_dims, compile_config) -> None:
    for what, degree in (("tensor_parallel_degree", parallel_dims.tp),
                         ("pipeline_parallel_degree", parallel_dims.pp),
                         ("context_parallel_degree", parallel_dims.cp),
                         ("expert_parallel_degree", parallel_dims.ep)):
        if degree > 1:
            raise ArgumentError(f"torchtitan's parallelism.{what}={degree}: autopar chooses the "
                                "model's parallelism; set it to 1 and pass pins to "
                                "model_spec(..., tensor=..., pipeline=...)")
    if compile_config is not None and compile_config.enable and "model" in compile_config.components:
        raise ArgumentError("compile.enable with 'model' in compile.components: autopar runs "
                            "the model's planned program; pin compile=True to autopar instead")


def parallelize_fn(**options):
    """A torchtitan ``parallelize_fn`` that returns :class:`AutoparModel`; ``options`` are
    ``autopar.parallelize``'s keywords (pins such as ``data=2``, ``zero=3``, or ``plan=``)."""
    if "batch" in options:
        raise ArgumentError("parallelize_fn(batch=...): the model gathers the global batch "
                            "itself from torchtitan's data ranks; drop batch=")

    def parallelize(model, *, parallel_dims, training, parallelism=None, compile_config=None,
                    ac_config=None, dump_folder=None, **_):
        _refuse_titan_parallelism(parallel_dims, compile_config)
        titan_dist.clip_grad_norm_ = _clip_grad_norm_
        torch_compat()
        if parallel_dims.dp_enabled:
            mesh = parallel_dims.get_mesh("batch")
            group, rank, world = mesh.get_group(), mesh.get_local_rank(), mesh.size()
        else:
            group, rank, world = None, 0, 1
        rows = training.local_batch_size * world
        accumulate = max(1, training.global_batch_size // rows) if training.global_batch_size > 0 else 1
        return AutoparModel(model, rows=rows, seq_len=training.seq_len, group=group, rank=rank,
                            world=world, options=options, accumulate=accumulate)

    return parallelize


def model_spec(spec, **options):
    """``spec`` (a torchtitan ``ModelSpec``, e.g. ``model_registry("debugmodel")``) with
    autopar as its ``parallelize_fn`` and no ``pipelining_fn`` (autopar pipelines itself)."""
    return dataclasses.replace(spec, parallelize_fn=parallelize_fn(**options), pipelining_fn=None)
