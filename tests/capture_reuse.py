"""One capture per example model in a torchrun spawn (test infrastructure, for the workers).

A worker's cases build fresh instances of a few example models again and again, and every
rank's ``autopar.parallelize`` (and rank 0's planning) exports each one: ``torch.export`` is
most of a tiny case's CPU seconds. Inside :func:`same_model` the capture calls autopar's
planning and ``parallelize`` make (the full batch: ``driver.capture``; at micro-batch size:
``capture_microbatch``) return the graph captured before for the same model key, batch
shapes and micro-batch count; the first call captures as usual.

The key must name what decides the graph, the model and its loss: the worker passes the
example's name, and every instance it builds, with that loss, traces to the same graph
(parameters and buffers are placeholders; the runtime reads the weights from the case's own
instance). A graph whose loss rewrite keeps a model's buffers (``MicrobatchLoss.values``)
is never shared. Each time a graph is handed out again it is checked unchanged (code and
fingerprint): passes must leave their input alone, and one that does not fails the case
that reuses the graph, naming it.
"""
from __future__ import annotations

import contextlib

import autopar.solver.accumulate as accumulate
import autopar.solver.driver as driver
import autopar.solver.pipeline_search as pipeline_search
from autopar.capture import fingerprint

_GRAPHS: dict[tuple, tuple] = {}       # key -> (Captured, its code, its fingerprint)


def _shapes(tensors) -> tuple:
    return tuple((tuple(t.shape), str(t.dtype)) if hasattr(t, "shape") else repr(t) for t in tensors)


def _reused(key: tuple, make):
    hit = _GRAPHS.get(key)
    if hit is not None:
        cap, code, fp = hit
        if cap.gm.code != code or fingerprint(cap) != fp:
            raise AssertionError(f"the graph captured for {key} changed after it was captured "
                                 "(a pass rewrote its input in place)")
        return cap
    cap = make()
    spec = cap.microbatch_loss
    if spec is None or not spec.values:       # a loss reading model buffers keeps its own graph
        _GRAPHS[key] = (cap, cap.gm.code, fingerprint(cap))
    return cap


@contextlib.contextmanager
def same_model(name: str):
    """Inside, autopar captures the model and loss named ``name`` once per batch shape and
    micro-batch count (see the module docstring)."""
    full, micro = driver.capture, pipeline_search.capture_microbatch

    def capture(model, inputs, loss_fn=None, target=None):
        key = (name, "full", _shapes(inputs), _shapes([target]), loss_fn is None)
        return _reused(key, lambda: full(model, inputs, loss_fn, target))

    def capture_microbatch(model, inputs, loss_fn, target, m):
        key = (name, m, _shapes(inputs), _shapes([target]), loss_fn is None)
        return _reused(key, lambda: micro(model, inputs, loss_fn, target, m))

    patched = [(driver, "capture", capture),
               (pipeline_search, "capture_microbatch", capture_microbatch),
               (accumulate, "capture_microbatch", capture_microbatch)]
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in patched]
    for mod, attr, f in patched:
        setattr(mod, attr, f)
    try:
        yield
    finally:
        for mod, attr, f in saved:
            setattr(mod, attr, f)
