"""Context parallelism's attention (``autopar/ops/context_attention.py``): the sequence
sharded over a mesh axis through attention equals ``F.scaled_dot_product_attention`` on
one device, forward and the gradients of q, k and v, for both forms (ring, all-gather),
both layouts (head-tail balanced, contiguous), causal or not, with grouped-query attention;
on simulated (thread) ranks, and once on 2 gloo processes (``tests/context_worker.py``),
through ``DistComm.shift``. And the balanced layout's point: the same causal work on
every rank, where contiguous shards leave the last rank about (2c-1)/c times the mean."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.device import HOST
from autopar.ops.comm import ThreadWorld
from autopar.ops.context_attention import (FORMS, LAYOUTS, balanced_positions, balanced_shard,
                                           balanced_unshard, causal_work, context_attention,
                                           shard_positions)
from launch import case_result, torchrun_cases

B, H, HKV, D = 2, 4, 2, 8


def _inputs(seq, heads=H, kv_heads=HKV, dtype=torch.float32):
    g = torch.Generator().manual_seed(seq + kv_heads)
    q, do = (torch.randn(B, heads, seq, D, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, seq, D, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, do


def _reference(q, k, v, do, **kw):
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*full, **kw)
    out.backward(do)
    return [out.detach()] + [x.grad for x in full]


def _on_ranks(c, q, k, v, do, layout, **kw):
    """Output and q, k, v gradients of ``context_attention`` on ``c`` thread ranks, each
    rank's shards put back together in sequence order."""
    def shard(x, r):
        return balanced_shard(x, 2, r, c) if layout == "balanced" else x.chunk(c, 2)[r]

    def rank(comm):
        r = comm.coord[0]
        mine = [shard(x, r).clone().requires_grad_() for x in (q, k, v)]
        out = context_attention(*mine, 0, layout=layout, **kw)
        out.backward(shard(do, r))
        return [out.detach()] + [x.grad for x in mine]

    per_rank = ThreadWorld((c,)).run(rank)
    join = (lambda ps: balanced_unshard(ps, 2)) if layout == "balanced" else (lambda ps: torch.cat(ps, 2))
    return [join([got[j] for got in per_rank]) for j in range(4)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("c", [2, 4])
def test_equals_one_device(c, form, causal, layout):
    q, k, v, do = _inputs(8 * c)       # 16 or 32 positions: 2c chunks of 4 or 8
    want = _reference(q, k, v, do, is_causal=causal, enable_gqa=True)
    got = _on_ranks(c, q, k, v, do, layout, form=form, causal=causal, enable_gqa=True)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("c", [1, 2, 4])
def test_fused_pairs_equal_one_device(monkeypatch, c, form, layout):
    """The piece pairs run by torch's fused flash kernels (the path a GPU takes in 16-bit,
    ``FUSED_DEVICES``), here the CPU's own, forward and backward with the whole row's
    log-sum-exp: the causal diagonal blocks with ``is_causal``, the rest unmasked."""
    import autopar.ops.context_attention as ca
    monkeypatch.setattr(ca, "FUSED_DEVICES", (*ca.FUSED_DEVICES, HOST))
    calls = []
    for name in ("_flash_fwd", "_flash_bwd"):
        real = getattr(ca, name)
        monkeypatch.setattr(ca, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    q, k, v, do = _inputs(8 * c)
    want = _reference(q, k, v, do, is_causal=True, enable_gqa=True)
    got = _on_ranks(c, q, k, v, do, layout, form=form, causal=True, enable_gqa=True)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert "_flash_fwd" in calls and "_flash_bwd" in calls


@pytest.mark.parametrize("form", FORMS)
def test_plain_heads_scale_and_float64(form):
    """As many K/V heads as query heads, an explicit scale, float64 (and so its tolerance)."""
    q, k, v, do = _inputs(24, kv_heads=H, dtype=torch.float64)
    want = _reference(q, k, v, do, is_causal=True, scale=0.3)
    got = _on_ranks(3, q, k, v, do, "balanced", form=form, causal=True, scale=0.3)
    for a, b in zip(got, want):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_one_rank_is_plain_attention():
    q, k, v, do = _inputs(16)
    want = _reference(q, k, v, do, is_causal=True, enable_gqa=True)
    got = _on_ranks(1, q, k, v, do, "balanced", form="ring", enable_gqa=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_named():
    q, k, v, _ = _inputs(16)

    def rank(comm):
        with pytest.raises(ValueError, match="enable_gqa"):
            context_attention(q, k, v, 0)               # 4 query heads, 2 K/V heads
        with pytest.raises(ValueError, match="form="):
            context_attention(q, k, v, 0, form="tree", enable_gqa=True)
        with pytest.raises(ValueError, match="do not divide"):
            context_attention(q[:, :, :3], k[:, :, :3], v[:, :, :3], 0, enable_gqa=True)

    ThreadWorld((2,)).run(rank)


def test_balanced_shard_round_trips_and_names_positions():
    c, seq = 4, 16
    x = torch.arange(seq).view(1, seq)
    parts = [balanced_shard(x, 1, r, c) for r in range(c)]
    assert parts[0].tolist() == [[0, 1, 14, 15]] and parts[3].tolist() == [[6, 7, 8, 9]]
    assert torch.equal(balanced_unshard(parts, 1), x)
    for r in range(c):           # the positions a rank holds are those its shard holds
        assert torch.equal(balanced_positions(seq, r, c), parts[r][0])
        assert torch.equal(shard_positions(seq, r, c, "contiguous"), x.chunk(c, 1)[r][0])


@pytest.mark.parametrize("c", [2, 4, 8])
def test_balanced_layout_evens_causal_work(c):
    """Unmasked (query, key) pairs per rank, counted from the positions each rank holds:
    equal on every rank balanced; contiguous, the last rank does about (2c-1)/c the mean."""
    seq = 16 * c
    for layout in LAYOUTS:
        counted = [int((shard_positions(seq, r, c, layout)[:, None] >= torch.arange(seq)).sum())
                   for r in range(c)]
        assert counted == [causal_work(seq, r, c, layout) for r in range(c)]
        assert sum(counted) == seq * (seq + 1) // 2
        if layout == "balanced":
            assert len(set(counted)) == 1, counted
        else:
            assert counted == sorted(counted) and counted[0] < counted[-1]
    long = 1 << 16
    mean = long * (long + 1) / 2 / c
    assert causal_work(long, c - 1, c, "contiguous") / mean == pytest.approx((2 * c - 1) / c, rel=1e-3)
    assert causal_work(long, 0, c, "balanced") / mean == pytest.approx(1, rel=1e-3)


def test_thread_shift_passes_along_the_ring():
    def rank(comm):
        t = torch.tensor([float(comm.coord[1])])
        return [comm.shift(t, 1, off).item() for off in (1, -1, 2, 4)]

    got = ThreadWorld((2, 4)).run(rank)       # axis 1: rings of 4 within each row
    for r, vals in enumerate(got):
        i = r % 4
        assert vals == [float((i - off) % 4) for off in (1, -1, 2, 4)], (r, vals)


@pytest.fixture(scope="module")
def gloo_result(tmp_path_factory):
    return torchrun_cases("context_worker.py", 2, [{"id": "ring"}],
                          tmp_path_factory.mktemp("context") / "r.json", timeout=300, case_timeout=60)


def test_ring_on_gloo_processes(gloo_result):
    """``DistComm.shift`` (batch_isend_irecv on the axis' group) and both forms on 2 gloo
    ranks equal one device (each rank checks its own shard: ``tests/context_worker.py``)."""
    r = case_result(gloo_result, "ring")
    assert r["shifted"] == {"1": 1.0, "-1": 1.0, "2": 0.0}
    assert max(r["errors"].values()) < 1e-5, r["errors"]
