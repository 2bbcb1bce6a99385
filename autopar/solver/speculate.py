"""The free search's sharding ILPs solved ahead, on the machine's other cores.

The free search (``driver.search_captured`` on a cluster of several nodes) solves one
intra-stage program, or a few (ZeRO stages, recomputation), per (pipeline degree, stage
mesh) of the pipeline search (``pipeline_free._DegreeSearch``), in a fixed order; then the
unpipelined plan's meshes, and its fewest-recomputed-layers probes if it could win. What
the search does with a solution depends on the best plan found before it (its bound);
which programs it solves does not (the probes: whether it solves them at all). So forked
workers solve them ahead, as jobs:

- the jobs are listed so that the workers begin where the search ends: a worker takes the
  last one no one has taken, the search the one it reaches (``take``), under one lock; the
  stage meshes are last, in the search's order, and before them the unpipelined plan's
  programs, one job per mesh and recomputation choice (``flat.mesh_jobs``), and then its
  probes (``driver.search_captured``), which the workers take after the meshes;
- a program that is a job of its own is written as soon as it is solved, by the search or
  a worker (``publish``): the search waits for a worker's, a worker reads the search's
  where written and otherwise solves it too (``done``: a worker never waits);
- a worker does its job exactly as the search would (the same calls into ``flat._search``)
  and writes every program's outcome, keyed by the program's inputs (``flat._ilp_key``),
  to a file of its own; the search, reaching a job a worker took, waits for that file;
- the search's own ``flat._search`` then reads an outcome (a :class:`ilp.Solution`, or
  that nothing fits) instead of building and solving the program (``lookup``).

The same program gives CBC the same solution, so the plan is the one the search finds
alone; the workers cost CPU seconds (some on probes the search does not need), not plan
quality, and the wall clock gains. A worker that fails or dies leaves its job to the
search. Workers are forked processes (``multiprocessing``'s fork context: the graph,
prices and caches are shared, not pickled; a worker runs no kernel, captures nothing and
prints nothing); none is started where fork is missing, when ``AUTOPAR_PLAN_WORKERS=0``,
for a graph of fewer than :data:`MIN_NODES` nodes (a fork costs more than its programs),
or with a profiler (which measures ops on the device).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
from typing import Callable, Hashable, Sequence

from autopar.errors import ArgumentError

MIN_NODES = 1000
"""Graphs smaller than this are searched without workers: their programs take
milliseconds, a fork of a process holding torch tens of them."""

FREE, SEARCH, WORKER = 0, 1, 2
"""Who took a job: no one, the search, worker k (``WORKER + k``)."""

_ACTIVE: "Speculation | None" = None
"""The speculation the search reads outcomes from (``lookup``), while one runs."""

_RECORDING: dict | None = None
"""In a worker: the outcomes of the job it is doing, by program key."""

_WORKING: "Speculation | None" = None
"""In a worker: the speculation it works for."""


def workers_for(n_nodes: int, profiler=None) -> int:
    """How many workers a search of a graph of ``n_nodes`` nodes gets: the cores this
    process may run on, less its own (``AUTOPAR_PLAN_WORKERS`` overrides; 0: none)."""
    if profiler is not None or "fork" not in mp.get_all_start_methods():
        return 0
    env = os.environ.get("AUTOPAR_PLAN_WORKERS")
    if env is not None:
        if not env.strip().isdigit():
            raise ArgumentError(f"AUTOPAR_PLAN_WORKERS={env!r}: set it to a whole number of "
                                "worker processes (0: plan in this process only)")
        return int(env)
    if n_nodes < MIN_NODES:
        return 0
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(cores - 1, 0)


class Speculation:
    """Workers doing the jobs ``items`` (each passed to ``solve``, which runs the search's
    own solving of it) from the end of the list while the search goes its way. A context
    manager: leaving it stops the workers and removes their files."""

    def __init__(self, items: Sequence, solve: Callable, workers: int):
        ctx = mp.get_context("fork")
        self.items = list(items)
        self.index = {item: i for i, item in enumerate(self.items)}
        self.taken = ctx.Array("i", len(self.items))        # FREE / SEARCH / WORKER + k per job
        self.dir = tempfile.mkdtemp(prefix="autopar-plan-")
        self.outcomes: dict = {}          # program key -> Solution, or the infeasible message
        self.read: set[int] = set()       # jobs whose worker file was read
        self.waited_s = 0.0               # the search's wall seconds waiting for a worker
        self.best = ctx.Value("d", float("inf"), lock=False)    # the search's best so far (s)
        self.me = SEARCH                  # who this process is (a worker: WORKER + k)
        self.procs = []
        for k in range(workers):
            proc = ctx.Process(target=self._work, args=(solve, k), daemon=True)
            proc.start()
            self.procs.append(proc)

    # ---- the search's side ------------------------------------------------------------------

    def take(self, item) -> None:
        """Before the search solves ``item``: take it, or, where a worker took it, wait for
        that worker's outcomes (``lookup`` then finds them)."""
        index = self.index.get(item)
        if index is None:
            return
        with self.taken.get_lock():
            who = self.taken[index]
            if who == FREE:
                self.taken[index] = SEARCH
        if who >= WORKER and index not in self.read:
            self._wait_for(index, self.procs[who - WORKER])

    def publish(self, key: Hashable, outcome) -> None:
        """The outcome of the program ``key``, where that program is a job of its own (one of
        ``flat.mesh_jobs``), written at once for whoever reads it next (``take``,
        ``done``), whichever process solved it."""
        index = self.index.get(key)
        if index is None:
            return
        tmp = f"{self._path(index)}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump({key: outcome}, f)
        os.replace(tmp, self._path(index))

    def found(self, step_s: float) -> None:
        """The search's best predicted step so far, for the workers' jobs that are worth
        doing only below it (``best_found_s``)."""
        if step_s < self.best.value:
            self.best.value = step_s

    def lookup(self, key: Hashable):
        """A worker's outcome for the program ``key``: a Solution, ``("infeasible",
        message)``, or None when no worker solved it."""
        return self.outcomes.get(key)

    def _wait_for(self, index: int, proc) -> None:
        t0 = time.perf_counter()
        path = self._path(index)
        while not os.path.exists(path):
            if not proc.is_alive() and not os.path.exists(path):
                break                       # the worker died: the search solves it itself
            time.sleep(0.002)
        if os.path.exists(path):
            with open(path, "rb") as f:
                self.outcomes.update(pickle.load(f))
            self.read.add(index)
        self.waited_s += time.perf_counter() - t0

    def close(self) -> None:
        """Stop the workers (their part is over) and remove their files."""
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Speculation":
        global _ACTIVE
        _ACTIVE = self
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- a worker's side --------------------------------------------------------------------

    def _path(self, index: int) -> str:
        return os.path.join(self.dir, f"{index}.pkl")

    def _claim_last(self, k: int) -> int | None:
        with self.taken.get_lock():
            for i in range(len(self.items) - 1, -1, -1):
                if self.taken[i] == FREE:
                    self.taken[i] = WORKER + k
                    return i
        return None

    def done(self, key: Hashable):
        """In a worker, before it solves the program ``key``: where that program is a job, its
        outcome if someone has written it; else None, and the job is this worker's if no one
        had taken it (a worker never waits: it solves what another process is still
        solving)."""
        index = self.index.get(key)
        if index is None:
            return None
        with self.taken.get_lock():
            if self.taken[index] == FREE:
                self.taken[index] = self.me
                return None
        try:
            with open(self._path(index), "rb") as f:
                return pickle.load(f).get(key)
        except (OSError, EOFError, pickle.UnpicklingError):
            return None

    def _work(self, solve: Callable, k: int) -> None:
        """Worker ``k``'s life: the last free job, done and its outcomes written, until none
        is left."""
        global _RECORDING, _ACTIVE, _WORKING
        _ACTIVE, _WORKING = None, self
        self.me = WORKER + k
        while (i := self._claim_last(k)) is not None:
            _RECORDING = {}
            try:
                solve(self.items[i])
            except Exception:       # the search meets it again when it does the job
                pass
            tmp = self._path(i) + ".tmp"
            with open(tmp, "wb") as f:
                pickle.dump(_RECORDING, f)
            os.replace(tmp, self._path(i))
        _RECORDING = None


def read(key: Hashable):
    """Before solving the program ``key``: the outcome another process found for it (None:
    solve it). The search takes a program that is a job of its own, or waits for the worker
    that took it (``Speculation.take``); a worker reads what is written (``done``)."""
    if _ACTIVE is not None:
        _ACTIVE.take(key)
        return _ACTIVE.lookup(key)
    return _WORKING.done(key) if _WORKING is not None else None


def record(key: Hashable, outcome) -> None:
    """After solving the program ``key``: in a worker, keep its outcome for the search; a
    program that is a job of its own is written at once, from either side (``publish``)."""
    if _RECORDING is not None:
        _RECORDING[key] = outcome
    spec = _ACTIVE if _ACTIVE is not None else _WORKING
    if spec is not None:
        spec.publish(key, outcome)


def active() -> "Speculation | None":
    """The speculation the search reads from, if one runs."""
    return _ACTIVE


def best_found_s() -> float:
    """In a worker: the search's best predicted step so far (``Speculation.found``);
    infinity elsewhere."""
    return _WORKING.best.value if _WORKING is not None else float("inf")


def recording() -> bool:
    """Whether this process is a worker doing a job ahead."""
    return _RECORDING is not None
