"""Run by tests/test_context_attention.py under torchrun (2 gloo ranks): the communicator's
``shift`` between real processes, and context-parallel attention (the ring over ``shift``,
and the all-gather form) against ``F.scaled_dot_product_attention`` on the whole sequence,
computed by each rank from the same seed. Rank 0 writes one result per case
(``tests/worker_loop.py``)."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autopar.device import rank_device  # noqa: E402
from autopar.ops.comm import DistComm, use_comm  # noqa: E402
from autopar.ops.context_attention import balanced_shard, context_attention  # noqa: E402
from worker_loop import run_cases  # noqa: E402


def attention_error(comm: DistComm, form: str, layout: str) -> float:
    """The largest difference of this rank's output and q, k, v gradients from one device's."""
    c, r = comm.size(0), comm.coord[0]
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(1, 4, 16, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(2))
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    ref.backward(do)

    def shard(x):
        return balanced_shard(x, 2, r, c) if layout == "balanced" else x.chunk(c, 2)[r]

    mine = [shard(x).to(comm.device).requires_grad_() for x in (q, k, v)]
    with use_comm(comm):
        out = context_attention(*mine, 0, form=form, causal=True, enable_gqa=True, layout=layout)
        out.backward(shard(do).to(comm.device))
    pairs = [(out, ref)] + [(m.grad, f.grad) for m, f in zip(mine, full)]
    return max((a.detach().cpu() - shard(b.detach())).abs().max().item() for a, b in pairs)


def run_case(case: dict) -> dict:
    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),), mesh_dim_names=("context",))
    comm = DistComm(mesh, timeout=60)
    t = torch.full((3,), float(comm.coord[0]), device=comm.device)
    n, i = comm.size(0), comm.coord[0]
    shifted = {off: comm.shift(t, 0, off)[0].item() for off in (1, -1, 2)}
    errors = {f"{form} {layout}": attention_error(comm, form, layout)
              for form, layout in (("ring", "balanced"), ("all-gather", "contiguous"))}
    # checked on every rank (a rank that raises is the one reported)
    assert shifted == {off: float((i - off) % n) for off in shifted}, shifted
    assert max(errors.values()) < 1e-5, errors
    return {"rank": i, "shifted": {str(k): x for k, x in shifted.items()}, "errors": errors}


if __name__ == "__main__":
    run_cases(run_case)
