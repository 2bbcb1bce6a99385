"""What a process spent, from Linux ``/proc``: the CPU seconds it ran, the seconds its
threads were runnable but waited for a core, and its I/O (:func:`io_progress`). They tell a
hang (none grows) from a busy machine (the wait grows) or one short of memory (the process
blocked on I/O: paging, reading a file) for the sweep's and the launches' watchdogs
(``benchmarks/sweep.py``, ``tests/worker_loop.py``). None where ``/proc`` does not say."""
from __future__ import annotations

import os


def cpu_seconds(pid: int | str = "self") -> float | None:
    """User + system CPU seconds of process ``pid`` (fields 14-15 of ``/proc/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def waited_seconds(pid: int | str = "self") -> float | None:
    """Seconds the threads of process ``pid`` have spent runnable but waiting for a core:
    the second field (ns) of each ``/proc/<pid>/task/<tid>/schedstat``, summed."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[1])
            except FileNotFoundError:       # a thread that ended between the two reads
                continue
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


IO_FIELDS = ("rchar", "wchar", "read_bytes", "write_bytes")
"""The fields of ``/proc/<pid>/io`` :func:`io_progress` sums: bytes through read and write
calls (pipes and files) and bytes fetched from or sent to storage (page-ins of file pages)."""


def io_progress(pid: int | str = "self", proc: str = "/proc") -> tuple[bool, int] | None:
    """(whether a thread of process ``pid`` is in uninterruptible sleep, state ``D`` of
    ``/proc/<pid>/task/<tid>/stat``: blocked on I/O, a page fault served from disk under
    memory pressure; a counter that grows with its I/O: :data:`IO_FIELDS` of
    ``/proc/<pid>/io`` plus its major page faults, field 12 of ``/proc/<pid>/stat``). A
    process sleeping in a collective is in state ``S`` and does no I/O; one paged in and out
    by a machine short of memory does. ``proc``: where ``/proc`` is (a test's fake one).
    None where it does not say."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            count = int(f.read().rsplit(")", 1)[1].split()[9])
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
