"""What a process spent, from Linux ``/proc``: the CPU seconds it ran and the seconds its
threads were runnable but waited for a core. The two tell a hang (neither grows) from a
busy machine (the wait grows) for the sweep's and the launches' watchdogs
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
