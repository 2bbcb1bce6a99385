"""How often a gloo program that ends without ``destroy_process_group`` aborts at exit, and
whether autopar's ``atexit`` handler (``autopar.ops.comm._collect_at_exit``) stops it.

    python benchmarks/gloo_exit.py --runs 30              # plain torch: the group left
    python benchmarks/gloo_exit.py --runs 30 --mode autopar   # autopar's handler registered
    python benchmarks/gloo_exit.py --runs 30 --mode destroy   # destroyed before the end

Each run launches two gloo ranks with torchrun (three all-gathers, then the script ends),
beside three busy loops (the abort is a race that load widens). A gloo worker thread lets
go of a finished collective's tensors after the rank has moved on; when that happens in
interpreter shutdown, it cannot take the GIL and the process aborts with "terminate called
without an active exception" (exit -6). Prints the runs that failed.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile

RANK_SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
for _ in range(3):
    outs = [torch.empty(1000) for _ in range(2)]
    dist.all_gather(outs, torch.full((1000,), float(dist.get_rank())))
    del outs
mode = sys.argv[1]
if mode == "destroy":
    dist.destroy_process_group()
elif mode == "autopar":
    from autopar.ops import comm
    comm._free_groups_at_exit()      # what the first DistComm registers
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--mode", choices=("keep", "autopar", "destroy"), default="keep")
    ap.add_argument("--busy", type=int, default=3, help="busy loops beside the runs")
    a = ap.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    failed = []
    try:
        with tempfile.TemporaryDirectory() as d:
            script = os.path.join(d, "ranks.py")
            with open(script, "w") as f:
                f.write(RANK_SCRIPT)
            for i in range(a.runs):
                proc = subprocess.run(
                    [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                     "--master-addr", "127.0.0.1", "--master-port", str(free_port()), script, a.mode],
                    capture_output=True, text=True, timeout=300, env=env)
                if proc.returncode != 0:
                    why = "terminate called" if "terminate called" in proc.stderr else "other"
                    failed.append((i, proc.returncode, why))
    finally:
        for p in busy:
            p.kill()
    print(f"mode {a.mode}: {len(failed)} of {a.runs} runs failed "
          + (", ".join(f"run {i} exit {rc} ({why})" for i, rc, why in failed) if failed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
