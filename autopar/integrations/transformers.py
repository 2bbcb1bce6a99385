"""The Hugging Face ``Trainer`` with its model run by ``autopar.parallelize``.

One added line in a Trainer script::

    from transformers import Trainer, TrainingArguments
    from autopar.integrations.transformers import AutoparTrainer as Trainer   # the line

    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds)
    trainer.train()
    trainer.save_model("out")      # a plain Hugging Face checkpoint: from_pretrained reads it

and ``torchrun --nproc-per-node N script.py``. ``AutoparTrainer(..., autopar={"data": 2,
"zero": 3})`` passes pins (or ``plan=``, ``cluster=``, ...) to ``autopar.parallelize``;
without it the solver chooses the plan for the job's world.

What the Trainer's extension points are given, and why:

- **The model.** At construction, the plan is made for the batch the Trainer will feed:
  the collated first ``per_device_train_batch_size x world_size`` training samples (only
  their shapes and dtypes matter), with the model's own loss (``labels`` in the batch).
  ``_wrap_model`` returns :class:`TrainerModule` (``model(**batch)`` is ``{"loss":
  pm(*tensors)}``, differentiable; ``no_sync`` is ``pm.no_sync``), so the Trainer never
  wraps the model in DDP and accelerate never prepares it. ``trainer.model`` stays the
  transformers model (its config, ``save_pretrained``); after ``train()`` and before every
  save it holds the trained weights (``pm.full_state_dict()``, a collective).
- **The data.** The Trainer's own data loader is kept as it is: accelerate gives rank ``r``
  batch ``r`` of every ``world_size`` consecutive batches of ``per_device_train_batch_size``
  rows, exactly the rows a DDP job of the same script trains on. :class:`TrainerModule`
  all-gathers the ranks' rows (in rank order: the global batch of one device's loader with
  ``per_device_train_batch_size x world_size`` rows) and gives ``pm`` the global batch
  (``batch="global"``): every plan (tensor, ZeRO-3, a free one) then takes its own part,
  whatever its data degree. The rows must have one shape every step (pad to a fixed
  length: ``padding="max_length"``), as the plan is made for it.
- **The loss.** The model's own loss on the global batch (its mean over the label tokens),
  divided by ``gradient_accumulation_steps`` by the Trainer (``model_accepts_loss_kwargs``
  is False: no ``num_items_in_batch`` into a captured graph). Equal to one device's token
  weighting when every micro-batch holds the same number of label tokens (always with
  ``gradient_accumulation_steps=1``). Accumulation runs the micro-batches but the last
  under ``pm.no_sync()`` (the Trainer's ``accelerator.no_sync(model)`` finds it).
- **The optimizer** is built over ``pm``'s local parameters (the Trainer's
  ``get_optimizer_cls_and_kwargs``, AdamW by default), with the Trainer's weight-decay
  split read from the transformers model's module types and names.
- **Gradient clipping** (``max_grad_norm``, 1.0 by default) clips by the norm of the whole
  gradient across shards: each rank's squared local norms, each divided by the number of
  ranks holding that block (its replicas), summed over the ranks (:func:`global_grad_norm`).
- **Evaluation** (``evaluate``, ``eval_strategy``) runs ``pm`` without gradients on the
  gathered batch and reports the model's own loss; the plan's batch shape holds there too
  (``per_device_eval_batch_size = per_device_train_batch_size``). Only the loss comes back
  (no logits: ``compute_metrics`` gets none).
- **Checkpoints.** ``save_model`` writes the whole model with ``save_pretrained`` (rank 0,
  after the collective gather). A ``checkpoint-N`` also holds ``autopar/``: each rank's
  shards of the model and of the optimizer state (``autopar.save_checkpoint``, DCP: it
  loads into any plan and world size); ``train(resume_from_checkpoint=...)`` reads it back
  through the Trainer's own ``_load_from_checkpoint`` / ``_load_optimizer_and_scheduler``.

Refused with an ``autopar.ArgumentError`` that names the fix: DeepSpeed or FSDP arguments
(they parallelize the model too), a pipelined plan (its schedule runs forward and backward
together: use ``pm.train_step``), an ``optimizers=`` pair built over the whole model,
``compute_loss_func`` / label smoothing (a loss outside the model), batches without
``labels`` or with other shapes than the plan's.
"""
from __future__ import annotations

import itertools
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

try:
    from transformers import Trainer
    from transformers.trainer import SCHEDULER_NAME
except ImportError as e:        # pragma: no cover - the integration needs its framework
    raise ImportError("autopar.integrations.transformers needs transformers and accelerate: "
                      "pip install transformers accelerate") from e

import autopar
from autopar.device import backend_for, rank_device
from autopar.errors import ArgumentError
from autopar.integrations.grad_norm import global_grad_norm

CHECKPOINT_DIR = "autopar"      # each rank's shards, inside the Trainer's checkpoint-N
PREFIX = "model."               # KeywordInputs holds the transformers model as .model

__all__ = ["AutoparTrainer", "KeywordInputs", "TrainerModule", "global_grad_norm"]


class KeywordInputs(nn.Module):
    """``forward(*tensors) -> model(**dict(zip(names, tensors))).loss``: the transformers
    model in the form autopar captures (positional tensor inputs, one scalar loss out)."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.names = tuple(names)

    def forward(self, *tensors):
        out = self.model(**dict(zip(self.names, tensors)), use_cache=False)
        return out["loss"] if isinstance(out, dict) else out[0]


class TrainerModule(nn.Module):
    """The model the Trainer calls: ``model(**batch)`` all-gathers each rank's rows into the
    global batch and returns ``{"loss": pm(*global_batch)}`` (differentiable);
    ``no_sync()`` is ``pm.no_sync()``; ``parameters()`` are ``pm``'s local shards."""

    def __init__(self, pm: nn.Module, names: tuple[str, ...], shapes: dict[str, tuple]):
        super().__init__()
        self.pm = pm
        self.names = tuple(names)
        self.shapes = dict(shapes)      # the global batch the plan was made for

    def forward(self, **batch):
        if set(batch) != set(self.names):
            raise ArgumentError(f"AutoparTrainer: a batch with the keys {sorted(batch)}, the plan "
                                f"was made for {sorted(self.names)}: every batch must hold the "
                                "same inputs (the collator's output of the first samples)")
        tensors = tuple(_global_rows(batch[n]) for n in self.names)
        for n, t in zip(self.names, tensors):
            if tuple(t.shape) != self.shapes[n]:
                raise ArgumentError(
                    f"AutoparTrainer: {n!r} has the global shape {list(t.shape)} (every rank's "
                    f"rows together), the plan was made for {list(self.shapes[n])}: pad every "
                    "batch to one length (padding='max_length'), set dataloader_drop_last=True, "
                    "and per_device_eval_batch_size to per_device_train_batch_size")
        return {"loss": self.pm(*tensors)}

    def no_sync(self):
        return self.pm.no_sync()


def _global_rows(t: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of ``t`` in rank order (all-gather; ``t`` itself in one process).
    Accelerate's loader gives rank r the r-th of each ``world_size`` consecutive batches, so
    these are the rows of one device's loader with ``world_size`` times the batch."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"AutoparTrainer: a batch value of type {type(t).__name__}: the "
                            "batches must hold tensors only (what the model takes)")
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


class AutoparTrainer(Trainer):
    """``transformers.Trainer`` training the model through ``autopar.parallelize``.

    ``autopar``: keyword arguments of ``autopar.parallelize`` (pins such as ``data=2,
    zero=3``, or ``plan=``, ``cluster=``, ``check=``); None: the free plan for this world.
    Everything else is the Trainer's."""

    def __init__(self, *args, autopar: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._refuse_what_does_not_fit()
        # the model's own loss over the global batch; the Trainer divides it by the
        # accumulation steps (no num_items_in_batch into a captured graph)
        self.model_accepts_loss_kwargs = False
        self.autopar_module = self._parallelize(dict(autopar or {}))

    # ---- construction ----------------------------------------------------------------
    def _refuse_what_does_not_fit(self) -> None:
        a = self.args
        if a.deepspeed or self.is_deepspeed_enabled or a.fsdp or self.is_fsdp_enabled:
            which = "deepspeed" if (a.deepspeed or self.is_deepspeed_enabled) else "fsdp"
            raise ArgumentError(f"AutoparTrainer with TrainingArguments({which}=...): both would "
                                f"parallelize the model; drop {which}= (autopar's zero=3 pin "
                                "shards parameters, gradients and optimizer state)")
        if self.optimizer is not None:
            raise ArgumentError("AutoparTrainer(optimizers=(opt, sched)): that optimizer holds the "
                                "whole model's parameters, autopar trains each rank's shards; pass "
                                "optimizer_cls_and_kwargs=(cls, kwargs) (or args.optim) instead")
        if self.compute_loss_func is not None or self.label_smoother is not None:
            raise ArgumentError("AutoparTrainer trains the model's own loss (labels= in the batch); "
                                "compute_loss_func and label_smoothing_factor compute one outside "
                                "the model: drop them, or build the loss into the model's forward")

    def _example_batch(self, rows: int) -> dict[str, Any]:
        """The first ``rows`` training samples, collated as the Trainer collates them."""
        ds = self.train_dataset
        if ds is None:
            raise ArgumentError("AutoparTrainer needs train_dataset= when it is built: the plan "
                                "is made for the shape of its batches")
        collator = self.data_collator
        try:
            import datasets      # optional: transformers' datasets library, where installed
            is_hf = isinstance(ds, datasets.Dataset)
        except ImportError:
            is_hf = False
        if is_hf:
            ds = self._remove_unused_columns(ds, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        if isinstance(ds, torch.utils.data.IterableDataset):
            items = list(itertools.islice(iter(ds), rows))
        else:
            items = [ds[i] for i in range(min(rows, len(ds)))]
        if len(items) < rows:
            raise ArgumentError(f"AutoparTrainer: the global batch is {rows} samples "
                                f"(per_device_train_batch_size x world size), the training set "
                                f"has {len(items)}")
        return collator(items)

    def _parallelize(self, options: dict) -> TrainerModule:
        if "batch" in options:
            raise ArgumentError("AutoparTrainer(autopar={'batch': ...}): the trainer passes the "
                                "global batch itself (every rank's rows, gathered); drop batch=")
        rows = self._train_batch_size * max(1, self.args.world_size)
        batch = self._example_batch(rows)
        names = tuple(batch)
        bad = [n for n in names if not isinstance(batch[n], torch.Tensor)]
        if bad:
            raise ArgumentError(f"AutoparTrainer: the collated batch holds {bad}, not tensors; "
                                "the model's inputs must be tensors")
        if "labels" not in names:
            raise ArgumentError(f"AutoparTrainer: the batches hold {list(names)} and no labels: the "
                                "model's own loss is what autopar trains (a collator that adds "
                                "labels, e.g. DataCollatorForLanguageModeling(mlm=False))")
        example = tuple(batch[n] for n in names)
        _one_rank_group()
        pm = autopar.parallelize(KeywordInputs(self.model, names), example, None, **options)
        if pm.plan.pipeline_stages > 1:
            raise ArgumentError(
                f"AutoparTrainer: the plan has a {pm.plan.pipeline_stages}-stage pipeline; its "
                "schedule runs forward and backward together, which the Trainer's "
                "loss.backward() cannot drive: pin pipeline=1 here, or train it with "
                "loss = pm.train_step(...) in your own loop")
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"autopar: AutoparTrainer runs the plan mesh {tuple(pm.plan.mesh_shape)} "
                  f"{tuple(pm.plan.mesh_axes)} on a global batch of {rows} rows "
                  f"({self._train_batch_size} per rank x {max(1, self.args.world_size)} ranks)",
                  file=sys.stderr, flush=True)
        return TrainerModule(pm, names, {n: tuple(t.shape) for n, t in batch.items()})

    @property
    def pm(self):
        """The ``ParallelModule`` ``autopar.parallelize`` returned."""
        return self.autopar_module.pm

    # ---- the Trainer's extension points ------------------------------------------------
    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """No DDP, no accelerate: the parallel module runs the plan."""
        return self.autopar_module

    def create_optimizer(self, model=None):
        """The Trainer's optimizer (``args.optim`` or ``optimizer_cls_and_kwargs``, its weight
        decay on the parameters the Trainer would decay) over ``pm``'s local parameters."""
        if self.optimizer is not None:
            return self.optimizer
        decay = {PREFIX + n for n in self.get_decay_parameter_names(self.model)}
        local = [(n, p) for n, p in self.pm._local_params().items() if p.requires_grad]
        groups = [{"params": [p for n, p in local if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in local if n not in decay], "weight_decay": 0.0}]
        if self.optimizer_cls_and_kwargs is not None:
            cls, kwargs = self.optimizer_cls_and_kwargs
        else:
            cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        if any(k in kwargs for k in ("params", "model", "optimizer_dict")) or not isinstance(cls, type) \
                or not issubclass(cls, torch.optim.Optimizer):
            raise ArgumentError(f"AutoparTrainer: the optimizer {getattr(cls, '__name__', cls)} "
                                "(args.optim) is built over the whole model; use one over a list of "
                                "parameters (adamw_torch, sgd, adafactor, ...)")
        self.optimizer = cls(groups, **kwargs)
        return self.optimizer

    def _clip_grad_norm(self, model):
        return global_grad_norm(self.pm, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return global_grad_norm(self.pm, float("inf")) if grad_norm is None else grad_norm

    def train(self, *args, **kwargs):
        """``Trainer.train``; after it ``trainer.model`` holds the trained weights."""
        out = super().train(*args, **kwargs)
        self.weights_to_model()
        return out

    def weights_to_model(self) -> None:
        """Copy the trained weights (``pm.full_state_dict()``) into ``trainer.model``.
        Collective: every rank calls it."""
        full = self.pm.full_state_dict()
        model = self.model
        with torch.no_grad():
            for name, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                           model.named_buffers(remove_duplicate=False)):
                whole = full.get(PREFIX + name)
                if whole is not None:
                    t.copy_(whole.to(t.device))

    def _model_to_pm(self) -> None:
        """``trainer.model``'s weights into ``pm`` (each rank keeps its blocks)."""
        model = self.model
        sd = {PREFIX + n: t for n, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                                        model.named_buffers(remove_duplicate=False))}
        known = self.pm._shards.placements
        self.pm.load_full_state_dict({k: v.detach() for k, v in sd.items() if k in known})

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` of the trained weights: every rank gathers them (a
        collective), rank 0 writes them with ``save_pretrained``."""
        self.weights_to_model()
        super().save_model(output_dir, _internal_call=_internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Each rank's shards of the model and of the optimizer state under
        ``output_dir/autopar`` (``autopar.save_checkpoint``); the scheduler from rank 0."""
        autopar.save_checkpoint(os.path.join(output_dir, CHECKPOINT_DIR), self.pm,
                                _inner(self.optimizer))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._model_to_pm()

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the Trainer loads the best checkpoint's weights into
        ``trainer.model``; ``pm`` takes them too (the final save writes them)."""
        super()._load_best_model()
        self._model_to_pm()

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, CHECKPOINT_DIR)
        if not os.path.isdir(path):
            raise ArgumentError(f"AutoparTrainer: {checkpoint!r} has no {CHECKPOINT_DIR}/ (each "
                                "rank's optimizer shards): resume from a checkpoint AutoparTrainer "
                                "wrote, or load the weights with from_pretrained and train anew")
        autopar.load_checkpoint(path, self.pm, _inner(self.optimizer))
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(sched) and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))


def _one_rank_group() -> None:
    """``python script.py`` (no torchrun): a process group of this one rank, so the script
    runs as it does on one device (``autopar.parallelize`` needs a group)."""
    if dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return
    dist.init_process_group(backend_for(rank_device()), store=dist.HashStore(), rank=0, world_size=1)


def _inner(optimizer):
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)
