"""A rank's fault, told to the ranks waiting for it: one key of the job's store.

A rank that fails on its own (it ran out of memory) stops issuing collectives; its peers
would wait in theirs until the process group's timeout (30 minutes for gloo by default).
So the failing rank writes what happened under its communicator's key of the default
process group's store (the TCPStore ``torchrun`` sets up, which every rank reaches), and a
rank waiting for a collective of that communicator looks there every ``POLL_S`` seconds
of waiting (``DistComm._wait``): it then raises, naming the failing rank's error, instead
of waiting on.

A communicator's key is its place in the order this process made communicators
(``autopar/fault/comm<N>``): every rank builds its modules in the same order (SPMD), so
the same module has the same key on every rank. Each rendezvous round of torchrun's c10d
rendezvous wraps the store in a prefix of its own (``torch.rendezvous.<run id>.<round>``,
``dynamic_rendezvous._wrap_store``), so a restarted job never reads an old attempt's notice.
"""
from __future__ import annotations

import itertools

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

__all__ = ["POLL_S", "job_store", "next_key", "post", "posted"]

POLL_S = 0.25
"""Seconds a waiting rank waits between looks at the store (a choice: the bound on the time
from a peer's notice to this rank's error, plus one store round trip; measured 0.25 s in
``benchmarks/faults.py``). A wait that finishes sooner never reads the store, so a step
whose collectives finish in time pays nothing."""

_made = itertools.count()


def next_key() -> str:
    """The store key of the next communicator this process makes."""
    return f"autopar/fault/comm{next(_made)}"


def job_store():
    """The default process group's store (every rank of the job reaches it), or None."""
    if not dist.is_initialized():
        return None
    try:
        return _get_default_store()
    except (RuntimeError, ValueError):     # a group made without a store (e.g. a fake one)
        return None


def post(key: str, message: str) -> bool:
    """Write ``message`` under ``key`` for the other ranks; whether there was a store."""
    store = job_store()
    if store is None:
        return False
    store.set(key, message.encode())
    return True


def posted(key: str | None) -> str | None:
    """The message a rank wrote under ``key``, or None (no notice, no key, or no store)."""
    store = job_store() if key is not None else None
    if store is None or not store.check([key]):
        return None
    return store.get(key).decode()
