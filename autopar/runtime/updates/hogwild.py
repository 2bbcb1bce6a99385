"""Hogwild (Recht et al. 2011): ``autopar.hogwild(model, inputs, loss_fn, target=...,
processes=P)``, the option ``hogwild=P``.

P processes of one host train one copy of the parameters, kept in shared memory
(``model.share_memory()``), without locks: each process reads the current parameters, computes
the gradient of its own mini-batch and writes its SGD update into the shared tensors in
place, while the others do the same. Process p takes the rows ``(step * P + p) * batch ...``
(wrapping) of ``inputs``/``target``, so the P processes together read the data in order,
each step P mini-batches. Gradients are each process's own (torch allocates them after the
fork); only the parameters are shared. Returns each process's loss at each step
(:class:`HogwildResult`); the model's parameters are left as trained.

An entry point, not a pin of ``autopar.parallelize``: the processes are not torchrun ranks
and run no plan (each runs the whole model, as given, on the host); ``parallelize`` and
``plan`` refuse ``hogwild=`` with a pointer here. CPU only: shared memory between processes
of one host is what makes it lock-free, and CUDA tensors cannot be written by several
processes this way. With ``processes=1`` it is plain SGD (with ``momentum``), which the
tests check against one device.

torch provides the pieces (``torch.multiprocessing``, ``Tensor.share_memory_``; its
``mnist_hogwild`` example) but no maintained library wraps them for an arbitrary model, so
the loop is written here. Processes are forked where the platform allows (no pickling of
the model or data, start in milliseconds), else spawned.
"""
from __future__ import annotations

import multiprocessing
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.multiprocessing as mp
from torch import nn

from autopar.errors import ArgumentError, PinError
from autopar.device import HOST
from autopar.options import Options, refuse_hogwild_plan as refuse_in_plan  # noqa: F401


@dataclass
class HogwildResult:
    losses: torch.Tensor
    """(processes, steps): each process's mini-batch loss before its update at each step."""

    @property
    def first(self) -> float:
        return float(self.losses[:, 0].mean())

    @property
    def last(self) -> float:
        return float(self.losses[:, -1].mean())


def _rows(n: int, start: int, size: int) -> torch.Tensor:
    return torch.arange(start, start + size) % n


def _train(p: int, model: nn.Module, inputs: tuple, target, loss_fn, processes: int, steps: int,
           batch: int, lr: float, momentum: float, weight_decay: float, losses: torch.Tensor,
           optimizer) -> None:
    torch.set_num_threads(1)
    opt = (torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
           if optimizer is None else optimizer(model.parameters()))
    n = inputs[0].shape[0]
    for step in range(steps):
        idx = _rows(n, (step * processes + p) * batch, batch)
        opt.zero_grad(set_to_none=True)
        out = model(*(x[idx] for x in inputs))
        loss = loss_fn(out, target[idx]) if loss_fn is not None else out
        loss.backward()
        opt.step()                  # in place on the shared tensors, no lock
        losses[p, step] = loss.detach()


def make_rule(options: Options, comm, axis: int | None, params: dict):
    """``hogwild=`` has no rule in a plan: the ArgumentError pointing to ``autopar.hogwild``."""
    refuse_in_plan(options)


def hogwild(model: nn.Module, inputs: Sequence[torch.Tensor], loss_fn: Callable | None = None, *,
            target: torch.Tensor | None = None, processes: int = 2, steps: int = 100,
            batch_size: int = 32, lr: float = 0.01, momentum: float = 0.0,
            weight_decay: float = 0.0, optimizer: Callable | None = None) -> HogwildResult:
    """Train ``model`` (on the CPU) with Hogwild: ``processes`` processes, ``steps`` SGD steps
    each on ``batch_size`` rows of ``inputs`` (and ``target``) at a time, updating the shared
    parameters without locks (module docstring). ``optimizer``: a function of the parameters
    returning a torch optimizer (each process builds its own, so its state, e.g. AdamW's
    moments, is the process's; picklable where processes are spawned), instead of SGD with
    ``lr``, ``momentum``, ``weight_decay``. Blocks until every process is done."""
    Options.from_pins(hogwild=processes)        # PinError on a bad count
    inputs = tuple(inputs)
    if not inputs or not all(isinstance(x, torch.Tensor) for x in inputs):
        raise ArgumentError("hogwild: pass the training data as a tuple of tensors (rows along dim 0)")
    n = inputs[0].shape[0]
    if any(x.shape[0] != n for x in inputs) or (target is not None and target.shape[0] != n):
        raise ArgumentError("hogwild: inputs and target must have the same number of rows (dim 0)")
    for what, t in [*(("parameter " + k, v) for k, v in model.named_parameters()),
                    *(("input", x) for x in inputs), ("target", target)]:
        if isinstance(t, torch.Tensor) and t.device.type != HOST:
            raise PinError(f"hogwild: the {what} is on {t.device}; Hogwild shares parameters between "
                           "processes of one host in CPU shared memory: move the model and data to "
                           "the CPU (model.cpu()), or use autopar.parallelize with data= (and "
                           "staleness= for asynchronous updates) on GPUs")
    for k, v in (("steps", steps), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ArgumentError(f"hogwild: {k}={v!r} must be a positive integer")
    model.zero_grad(set_to_none=True)      # gradients stay each process's own
    model.share_memory()
    losses = torch.zeros(processes, steps).share_memory_()
    args = (model, inputs, target, loss_fn, processes, steps, batch_size, lr, momentum, weight_decay,
            losses, optimizer)
    if processes == 1:
        threads = torch.get_num_threads()
        try:
            _train(0, *args)
        finally:
            torch.set_num_threads(threads)
        return HogwildResult(losses.clone())
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    procs = [ctx.Process(target=_train, args=(p, *args), daemon=True) for p in range(processes)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()
    bad = [(i, pr.exitcode) for i, pr in enumerate(procs) if pr.exitcode != 0]
    if bad:
        raise RuntimeError(f"hogwild: process(es) {bad} (index, exit code) failed; see their stderr")
    return HogwildResult(losses.clone())
