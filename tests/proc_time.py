"""What a process spent, from Linux ``/proc``: the CPU seconds it ran, the seconds its
threads were runnable but waited for a core, and its I/O (:func:`io_progress`). They tell a
hang (none grows) from a busy machine (the wait grows) or one short of memory (the process
blocked on I/O: paging, reading a file) for the sweep's and the launches' watchdogs
(``benchmarks/sweep.py``, ``tests/worker_loop.py``). None where ``/proc`` does not say.

Each counts the process and its live descendants (:func:`process_tree`): a plan's search
solves programs in forked processes (``solver.speculate``'s workers, ``solver.bounded_solve``'s
CBC child) while the process that forked them sleeps waiting for their answer. Counted alone,
it made no progress for 30 s whenever a busy machine slowed a child that long (issue 43:
``gemma2:free-budget:194257`` ended as "a hang" at load ~200, 12 CPU seconds in 411 s)."""
from __future__ import annotations

import os


def _stat(pid, proc: str = "/proc") -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command's name (state first)."""
    with open(f"{proc}/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_tree(pid: int | str = "self", proc: str = "/proc") -> list[str]:
    """``pid`` and its live descendants (by the parent field of each ``/proc/<n>/stat``)."""
    root = str(os.getpid()) if pid == "self" and proc == "/proc" else str(pid)
    children: dict[str, list[str]] = {}
    try:
        names = [n for n in os.listdir(proc) if n.isdigit()]
    except OSError:
        return [root]
    for n in names:
        try:
            children.setdefault(_stat(n, proc)[1], []).append(n)
        except (OSError, IndexError):   # a process that ended between the two reads
            continue
    tree, i = [root], 0
    while i < len(tree):
        tree += children.get(tree[i], [])
        i += 1
    return tree


def cpu_seconds(pid: int | str = "self") -> float | None:
    """User + system CPU seconds of process ``pid`` and its descendants: fields 14-17 of
    each ``/proc/<n>/stat`` (its own and its waited-for children's), so that a child's
    seconds stay counted once it ends and is reaped. None where ``pid`` is gone."""
    total = 0
    for i, n in enumerate(process_tree(pid)):
        try:
            fields = _stat(n)
            total += sum(int(x) for x in fields[11:15])
        except (OSError, ValueError, IndexError):
            if i == 0:
                return None
    return total / os.sysconf("SC_CLK_TCK")


def waited_seconds(pid: int | str = "self") -> float | None:
    """Seconds the threads of process ``pid`` and of its descendants have spent runnable but
    waiting for a core: the second field (ns) of each ``/proc/<n>/task/<tid>/schedstat``,
    summed."""
    total = 0
    for i, n in enumerate(process_tree(pid)):
        try:
            for tid in os.listdir(f"/proc/{n}/task"):
                try:
                    with open(f"/proc/{n}/task/{tid}/schedstat") as f:
                        total += int(f.read().split()[1])
                except FileNotFoundError:       # a thread that ended between the two reads
                    continue
        except (OSError, ValueError, IndexError):
            if i == 0:
                return None
    return total / 1e9


IO_FIELDS = ("rchar", "wchar", "read_bytes", "write_bytes")
"""The fields of ``/proc/<pid>/io`` :func:`io_progress` sums: bytes through read and write
calls (pipes and files) and bytes fetched from or sent to storage (page-ins of file pages)."""


def io_progress(pid: int | str = "self", proc: str = "/proc") -> tuple[bool, int] | None:
    """(whether a thread of process ``pid`` or of a descendant is in uninterruptible sleep,
    state ``D`` of ``/proc/<n>/task/<tid>/stat``: blocked on I/O, a page fault served from
    disk under memory pressure; a counter that grows with their I/O: :data:`IO_FIELDS` of
    ``/proc/<n>/io`` plus the major page faults, field 12 of ``/proc/<n>/stat``). A process
    sleeping in a collective is in state ``S`` and does no I/O; one paged in and out by a
    machine short of memory does. ``proc``: where ``/proc`` is (a test's fake one). None
    where it does not say."""
    blocked, count = False, 0
    for i, n in enumerate(process_tree(pid, proc)):
        got = _io_one(n, proc)
        if got is None:
            if i == 0:
                return None
            continue
        blocked, count = blocked or got[0], count + got[1]
    return blocked, count


def _io_one(pid: str, proc: str) -> tuple[bool, int] | None:
    """:func:`io_progress` of one process."""
    try:
        count = int(_stat(pid, proc)[9])
    except (OSError, ValueError, IndexError):
        return None
    try:
        with open(f"{proc}/{pid}/io") as f:
            rows = dict(line.split(":", 1) for line in f if ":" in line)
        count += sum(int(rows[k]) for k in IO_FIELDS if k in rows)
    except (OSError, ValueError):       # /proc/<pid>/io unreadable: the faults alone
        pass
    blocked = False
    try:
        tids = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            with open(f"{proc}/{pid}/task/{tid}/stat") as f:
                blocked = blocked or f.read().rsplit(")", 1)[1].split()[0] == "D"
        except (OSError, IndexError):   # a thread that ended between the two reads
            continue
    return blocked, count
