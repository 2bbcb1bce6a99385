"""The strategies autopar plans, written by hand in torch, for ``runtime_overhead.py``.

Each builder takes the single-device GPT (``examples/gpt.py``; a deep copy is made) and
the global batch, and returns a ``Hand``: its optimizer's parameters and ``step()`` (forward,
backward, gradient sync; the caller runs the optimizer), which returns the global mean
loss of the batch. This is what a user would write with torch's own parallelism:

- ``ddp``: ``DistributedDataParallel``, each rank on its slice of the batch;
  (``ddp``, ``fsdp`` and ``tensor`` take ``compile=True``: the wrapped model through
  ``torch.compile``, as their users compile it);
- ``fsdp``: FSDP2, ``fully_shard`` on each transformer block, then on the root;
- ``tensor``: ``parallelize_module`` in Megatron's layout: ``ColwiseParallel`` on
  ``c_attn`` and ``c_fc``, ``RowwiseParallel`` on both ``c_proj``; the fused ``c_attn`` is
  permuted so each rank's rows are whole heads of q, k and v, and attention runs on the
  local heads; embeddings, norms and the head stay replicated;
- ``pipeline``: the model split by hand into ``n`` stages of consecutive blocks (the first
  with the embeddings, the last with ``ln_f``, the head and the loss), run by
  ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``/``Schedule1F1B``);
  the tied ``wte``/``lm_head`` weight's gradient is summed between the first and last
  stage, as Megatron does.
"""
from __future__ import annotations

import copy
import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Hand:
    params: list
    step: Callable[[], "torch.Tensor | None"]    # forward + backward + grad sync -> this rank's loss
    global_loss: Callable[["torch.Tensor | None"], torch.Tensor]    # a collective; checks only


def _mean_over_ranks(loss: torch.Tensor) -> torch.Tensor:
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss / dist.get_world_size()


def _same(loss: torch.Tensor) -> torch.Tensor:
    return loss.detach()


def _rank_slice(t: torch.Tensor) -> torch.Tensor:
    world, rank = dist.get_world_size(), dist.get_rank()
    b = t.shape[0] // world
    return t[rank * b:(rank + 1) * b]


def _compiled(m: nn.Module, compile: bool) -> nn.Module:
    """``m`` through ``torch.compile`` (Inductor, graph breaks allowed: DDP's buckets and
    FSDP2's hooks break graphs as torch users get them) when ``compile``."""
    return torch.compile(m) if compile else m


def ddp(model: nn.Module, x, y, loss_fn, compile: bool = False) -> Hand:
    from torch.nn.parallel import DistributedDataParallel as DDP
    m = DDP(copy.deepcopy(model))
    run = _compiled(m, compile)
    xs, ys = _rank_slice(x), _rank_slice(y)

    def step():
        loss = loss_fn(run(xs), ys)
        loss.backward()
        return loss
    return Hand(list(m.parameters()), step, _mean_over_ranks)


def fsdp(model: nn.Module, x, y, loss_fn, compile: bool = False) -> Hand:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    m = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in m.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(m, mesh=mesh)
    run = _compiled(m, compile)
    xs, ys = _rank_slice(x), _rank_slice(y)

    def step():
        loss = loss_fn(run(xs), ys)
        loss.backward()
        return loss
    return Hand(list(m.parameters()), step, _mean_over_ranks)


def _tp_attention_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``CausalSelfAttention.forward`` on this rank's heads (``self.n_head``/``n_embd`` local)."""
    B, T, _ = x.size()
    q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
    hs = self.n_embd // self.n_head
    q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = y.transpose(1, 2).contiguous().view(B, T, self.n_embd)
    return self.resid_dropout(self.c_proj(y))


def _per_head_rows(t: torch.Tensor, n_embd: int, tp: int) -> torch.Tensor:
    """Rows [q; k; v] of the fused projection reordered to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
    so that a contiguous dim-0 shard r holds rank r's heads of each of q, k and v."""
    q, k, v = t.split(n_embd, dim=0)
    parts = [p.chunk(tp, dim=0) for p in (q, k, v)]
    return torch.cat([torch.cat([parts[j][r] for j in range(3)]) for r in range(tp)])


def tensor(model: nn.Module, x, y, loss_fn, compile: bool = False) -> Hand:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module,
    )
    m = copy.deepcopy(model)
    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,))
    for block in m.transformer.h:
        attn = block.attn
        if attn.n_head % tp:
            raise ValueError(f"tensor parallel over {tp} ranks needs n_head % {tp} == 0 "
                             f"(n_head={attn.n_head})")
        with torch.no_grad():
            attn.c_attn.weight.copy_(_per_head_rows(attn.c_attn.weight, attn.n_embd, tp))
            if attn.c_attn.bias is not None:
                attn.c_attn.bias.copy_(_per_head_rows(attn.c_attn.bias, attn.n_embd, tp))
        attn.n_head, attn.n_embd = attn.n_head // tp, attn.n_embd // tp
        attn.forward = types.MethodType(_tp_attention_forward, attn)
        parallelize_module(block, mesh, {
            "attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(),
        })
    run = _compiled(m, compile)

    def step():
        loss = loss_fn(run(x), y)
        loss.backward()
        return loss
    return Hand(list(m.parameters()), step, _same)


class _Stage(nn.Module):
    """Blocks ``lo:hi`` of the GPT; the first stage embeds, the last adds ln_f and the head."""

    def __init__(self, gpt: nn.Module, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.h = nn.ModuleList(gpt.transformer.h[lo:hi])
        if first:
            self.wte, self.wpe = gpt.transformer.wte, gpt.transformer.wpe
        if last:
            self.ln_f = gpt.transformer.ln_f
            self.lm_head = nn.Linear(gpt.lm_head.in_features, gpt.lm_head.out_features, bias=False)
            self.lm_head.weight = nn.Parameter(gpt.lm_head.weight.detach().clone())   # untied here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(0, x.shape[1], dtype=torch.long, device=x.device)
            x = self.wte(x) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def pipeline(model: nn.Module, x, y, loss_fn, n_microbatches: int, schedule: str = "1f1b") -> Hand:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    world, rank = dist.get_world_size(), dist.get_rank()
    gpt = copy.deepcopy(model)
    n_layer = len(gpt.transformer.h)
    if n_layer % world:
        raise ValueError(f"a hand pipeline of {world} stages needs n_layer % {world} == 0 "
                         f"(n_layer={n_layer})")
    per = n_layer // world
    first, last = rank == 0, rank == world - 1
    sub = _Stage(gpt, rank * per, (rank + 1) * per, first, last)
    del gpt
    stage = PipelineStage(sub, rank, world, torch.device("cpu"))
    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    sched = cls(stage, n_microbatches, loss_fn=loss_fn)
    tied_group = dist.new_group([0, world - 1])     # every rank must call new_group
    tied = sub.wte.weight if first else sub.lm_head.weight if last else None

    def step():
        losses: list = []
        if first:
            sched.step(x)
        elif last:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        if tied is not None:        # the tied weight's gradient: sum of both uses
            dist.all_reduce(tied.grad, group=tied_group)
        return torch.stack(losses).mean() if last else None

    def global_loss(local):
        loss = local.detach().clone() if last else torch.zeros(())
        dist.broadcast(loss, src=world - 1)
        return loss
    return Hand(list(sub.parameters()), step, global_loss)
