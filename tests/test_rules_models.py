"""Every ATen call of small example models (GPT, Llama, BERT, ViT, ResNet, MLP), exported
as torch.export (non-strict, training IR) does, checked sharded against one device with
the arguments the model really passes (shape constants, ``-1`` sizes, full slices, ...).

A few strategy combinations per node (drawn with a fixed seed) keep this fast; the
per-op property tests in ``test_rules.py`` sweep the strategies exhaustively.
"""
from __future__ import annotations

import functools
import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.sharding.check import call_from_tensors, check_strategy
from autopar.sharding.registry import has_rule, mesh_strategies

aten = torch.ops.aten
B, T, H, NH, V = 4, 8, 16, 4, 32
COMBOS = {(2,): 3, (2, 2): 2}
# inputs (by position among the tensor inputs) that are buffers, not differentiable
NO_GRAD = {aten.batch_norm.default: (3, 4)}


class GPT(nn.Module):
    """nanoGPT-style: fused c_attn split into q, k, v; tied wte / lm_head; causal sdpa."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, H), nn.Embedding(T, H)
        self.ln1, self.ln2, self.lnf = nn.LayerNorm(H), nn.LayerNorm(H), nn.LayerNorm(H)
        self.c_attn, self.c_proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.fc, self.proj = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.lm_head.weight = self.wte.weight
        self.drop = nn.Dropout(0.0)

    def forward(self, idx, tgt):
        b, t = idx.shape
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(0, t, dtype=torch.long)))
        q, k, v = self.c_attn(self.ln1(x)).split(H, dim=2)
        q, k, v = [z.view(b, t, NH, -1).transpose(1, 2) for z in (q, k, v)]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, -1))
        x = x + self.proj(F.gelu(self.fc(self.ln2(x))))
        logits = self.lm_head(self.lnf(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1), ignore_index=-1)


def _rot_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Llama(nn.Module):
    """RMSNorm (hand-written and nn.RMSNorm), rotary cos/sin buffers, GQA by expand+reshape
    and by repeat_interleave, SwiGLU."""

    def __init__(self, nkv=2):
        super().__init__()
        self.nkv, self.hd = nkv, H // NH
        self.emb = nn.Embedding(V, H)
        self.n1, self.n2 = nn.Parameter(torch.ones(H)), nn.RMSNorm(H)
        self.q = nn.Linear(H, H, bias=False)
        self.k = nn.Linear(H, nkv * self.hd, bias=False)
        self.v = nn.Linear(H, nkv * self.hd, bias=False)
        self.o = nn.Linear(H, H, bias=False)
        self.gate, self.up = nn.Linear(H, 32, bias=False), nn.Linear(H, 32, bias=False)
        self.down, self.head = nn.Linear(32, H, bias=False), nn.Linear(H, V, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        e = torch.outer(torch.arange(T).float(), inv)
        e = torch.cat((e, e), -1)
        self.register_buffer("cos", e.cos())
        self.register_buffer("sin", e.sin())

    def forward(self, idx):
        b, t = idx.shape
        x = self.emb(idx)
        h = self.n1 * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        q = self.q(h).view(b, t, NH, self.hd).transpose(1, 2)
        k = self.k(h).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v(h).view(b, t, self.nkv, self.hd).transpose(1, 2)
        cos, sin = self.cos[:t][None, None], self.sin[:t][None, None]
        q, k = q * cos + _rot_half(q) * sin, k * cos + _rot_half(k) * sin
        rep = NH // self.nkv
        k = k[:, :, None].expand(b, self.nkv, rep, t, self.hd).reshape(b, NH, t, self.hd)
        v = torch.repeat_interleave(v, rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, -1))
        h = self.n2(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return self.head(x).float()


class Bert(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.tt = nn.Embedding(V, H), nn.Embedding(2, H)
        self.ln, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.o = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.ff, self.ff2 = nn.Linear(H, 64), nn.Linear(64, H)
        self.pool, self.cls = nn.Linear(H, H), nn.Linear(H, 4)

    def forward(self, idx, mask):
        b, t = idx.shape
        x = self.ln(self.emb(idx) + self.tt(torch.zeros_like(idx)))
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = [z.reshape(b, t, NH, -1).permute(0, 2, 1, 3) for z in (q, k, v)]
        sc = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        sc = sc + (1.0 - mask[:, None, None, :].to(sc.dtype)) * -1e4
        p = F.dropout(torch.softmax(sc, dim=-1), 0.0, self.training)
        y = (p @ v).permute(0, 2, 1, 3).reshape(b, t, -1)
        x = self.ln2(x + self.o(y))
        x = x + self.ff2(F.gelu(self.ff(x), approximate="tanh"))
        return self.cls(torch.tanh(self.pool(x[:, 0])))


class ViT(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, H, 4, 4)
        self.cls = nn.Parameter(torch.randn(1, 1, H))
        self.pos = nn.Parameter(torch.randn(1, 5, H))
        self.enc = nn.TransformerEncoderLayer(H, NH, 32, batch_first=True, dropout=0.0)
        self.ln, self.head = nn.LayerNorm(H), nn.Linear(H, 4)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.ln(self.enc(x))[:, 0])


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8)
        self.gn, self.fc = nn.GroupNorm(2, 8), nn.Linear(8, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.b1(self.c1(x))), 2)
        x = F.relu(self.b2(self.c2(x)) + x)
        x = self.gn(F.avg_pool2d(x, 2))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x, t):
        y = self.l2(torch.sigmoid(self.l1(x)) * torch.tanh(x.sum(-1, keepdim=True)))
        return F.mse_loss(y, t) + F.nll_loss(F.log_softmax(y, -1), t.argmax(-1)) + y.var()


def _models():
    g = torch.Generator().manual_seed(0)
    ids = lambda *s: torch.randint(0, V, s, generator=g)  # noqa: E731
    return {
        "gpt": (GPT, (ids(B, T), ids(B, T))),
        "llama": (Llama, (ids(B, T),)),
        "bert": (Bert, (ids(B, T), torch.ones(B, T, dtype=torch.long))),
        "vit": (ViT, (torch.randn(B, 3, 8, 8, generator=g),)),
        "resnet": (ResNet, (torch.randn(B, 3, 8, 8, generator=g),)),
        "mlp": (MLP, (torch.randn(B, 8, generator=g), torch.randn(B, 4, generator=g))),
    }


def _signature(op, a, kw):
    def key(v):
        if isinstance(v, torch.Tensor):
            return ("T", tuple(v.shape), v.dtype)
        if isinstance(v, (list, tuple)):
            return tuple(key(u) for u in v)
        return repr(v)
    return (op, key(a), key(tuple(sorted(kw.items()))))


@functools.lru_cache(maxsize=None)
def _calls(name):
    """(op, args, kwargs) of every distinct ATen call (by op, shapes and constants) the
    exported graph of model ``name`` makes, with real values."""
    torch.manual_seed(0)
    cls, args = _models()[name]
    ep = torch.export.export(cls().train(), args, strict=False)
    calls = []

    class Recorder(torch.fx.Interpreter):
        def call_function(self, target, a, kw):
            if isinstance(target, torch._ops.OpOverload):
                calls.append((target, a, kw))
            return super().call_function(target, a, kw)

    Recorder(ep.module()).run(*args)
    unique = {}
    for c in calls:
        unique.setdefault(_signature(*c), c)
    return list(unique.values())


@pytest.mark.parametrize("name", sorted(_models()))
def test_model_ops_match_single_device(name):
    rng = random.Random(0)
    checked = 0
    for op, a, kw in _calls(name):
        if not has_rule(op):
            continue
        call, _ = call_from_tensors(op, a, kw)
        for mesh, k in COMBOS.items():
            combos = mesh_strategies(call, mesh)[1:]   # the first is all-Replicate
            for combo in rng.sample(combos, min(k, len(combos))):
                check_strategy(op, a, kw, combo, mesh, rtol=1e-4, atol=1e-4,
                               no_grad=NO_GRAD.get(op, ()))
                checked += 1
    assert checked > 0


@pytest.mark.parametrize("name", sorted(_models()))
def test_model_ops_have_rules(name):
    """Coverage: every ATen op of the example models has a rule, except these."""
    allowed = {aten.arange.start, aten.arange.default, aten.add_.Tensor,
               aten.zeros.default, aten.full.default}
    missing = {str(op) for op, _, _ in _calls(name)
               if not has_rule(op) and op not in allowed}
    assert not missing, f"ops without a sharding rule in {name}: {sorted(missing)}"
