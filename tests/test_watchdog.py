"""The launches' per-case watchdog (``tests/worker_loop.Watchdog``): a case that hangs is
ended with every thread's stack at its limit; a case slowed by a busy machine (its threads
waiting for a core) has its deadline moved back; a case that ends in time is left alone.
Each in a process of its own (the watchdog ends its process)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(body: str, tmp_path) -> tuple[int, str]:
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {HERE!r})
        import worker_loop
        worker_loop.Watchdog.POLL_S = 0.2
        stack = open({str(tmp_path / 'stack')!r}, "w")
    """) + textwrap.dedent(body)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    return p.returncode, (tmp_path / "stack").read_text() + p.stdout


def test_a_hang_is_ended_at_its_limit_with_the_stacks(tmp_path):
    code, out = _run("""
        worker_loop.waited_seconds = lambda: 0.0          # no thread waits for a core
        dog = worker_loop.Watchdog(stack)
        dog.arm(1.0)
        time.sleep(10)
        print("not ended")
    """, tmp_path)
    assert code != 0 and "not ended" not in out
    assert "time.sleep" in out or "line" in out, out       # faulthandler's dump


def test_a_busy_machine_moves_the_deadline_back(tmp_path):
    code, out = _run("""
        clock = [0.0]
        def waited():                      # the threads wait for a core all the time
            clock[0] += worker_loop.Watchdog.POLL_S
            return clock[0]
        worker_loop.waited_seconds = waited
        dog = worker_loop.Watchdog(stack)
        dog.arm(1.0)
        time.sleep(3)                      # three limits, all of it queued
        dog.cancel()
        time.sleep(1.5)
        print("survived")
    """, tmp_path)
    assert code == 0 and "survived" in out, out


def test_the_push_is_bounded(tmp_path):
    code, out = _run("""
        clock = [0.0]
        def waited():
            clock[0] += worker_loop.Watchdog.POLL_S
            return clock[0]
        worker_loop.waited_seconds = waited
        worker_loop.Watchdog.MAX_PUSH = 1
        dog = worker_loop.Watchdog(stack)
        dog.arm(1.0)
        time.sleep(10)                     # past 1 + MAX_PUSH limits: ended anyway
        print("not ended")
    """, tmp_path)
    assert code != 0 and "not ended" not in out
