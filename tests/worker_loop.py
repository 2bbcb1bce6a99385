"""The loop the torchrun workers share: run each case on every rank, gather every rank's
verdict, and let rank 0 write one result per case (the first failing rank's, if any)."""
from __future__ import annotations

import gc
import json
import sys
import traceback
from typing import Callable

import torch.distributed as dist


def run_cases(run_case: Callable[[dict], dict]) -> None:
    """``argv[1]``: the cases as JSON; ``argv[2]``: where rank 0 writes the results."""
    cases = json.loads(sys.argv[1])
    out = sys.argv[2]
    dist.init_process_group("gloo")
    results = []
    for case in cases:
        print(f"[rank {dist.get_rank()}] case {case}", file=sys.stderr, flush=True)
        try:
            res = {"case": case, "ok": True, **run_case(case)}
        except Exception as e:  # noqa: BLE001 - reported to the test
            res = {"case": case, "ok": False, "error": f"{type(e).__name__}: {e}",
                   "trace": traceback.format_exc()[-3000:]}
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, res)
        if dist.get_rank() == 0:
            bad = [v for v in verdicts if not v["ok"]]
            results.append(bad[0] if bad else res)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    gc.collect()       # drop every module (and its work handles) before the groups go
    dist.barrier()
    dist.destroy_process_group()
