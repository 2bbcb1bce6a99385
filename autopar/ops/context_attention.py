"""Context parallelism's attention: the sequence sharded over a mesh axis *through*
scaled-dot-product attention, each rank's output shard equal to the matching rows of
``F.scaled_dot_product_attention`` on the whole sequence.

Layouts (which positions rank ``r`` of ``c`` holds, concatenated in this order):

- ``"contiguous"``: positions ``[r*S/c, (r+1)*S/c)``. Under a causal mask the last rank
  sees nearly all keys and the first almost none: the last does about ``(2c-1)/c`` times
  the mean work (:func:`causal_work`), and the step waits for it.
- ``"balanced"``: the sequence cut into ``2c`` chunks, rank ``r`` holding chunks ``r`` and
  ``2c-1-r`` (a head and a tail), so every rank does the same masked work
  (:func:`balanced_shard`, :func:`balanced_unshard`, :func:`balanced_positions`: rotary
  embeddings and masks follow the shard by these positions).

Forms (:func:`context_attention`), both an autograd function whose backward is the mirror:

- ``"all-gather"``: K/V gathered along the axis, each rank's queries against the whole
  sequence; backward gathers K/V again (the whole sequence's K/V is not held from forward to
  backward: that per-layer term is what context parallelism removes) and reduce-scatters
  dK/dV back to their owners.
- ``"ring"``: ``c`` steps; at each, the local queries attend to the K/V block held, and the
  block moves one rank on (:meth:`Comm.shift`); partial results are merged by log-sum-exp.
  Backward recomputes each block's probabilities from the saved log-sum-exp (the flash
  attention backward) while K/V go round again, their gradients travelling with them and
  arriving home after the last step: each step computes this rank's share of the held
  block's dK/dV while the sum so far arrives from the rank behind, adds it, and sends the
  total on while the next block is computed. A rank holds two K/V blocks at a time (and
  in backward two dK/dV blocks).

Each block is split into the pieces of positions its ranks hold (one per rank contiguous,
two balanced); a query piece against a key piece is skipped when every key is later than
every query, computed unmasked when every key is earlier or the mask is off, and masked
only on the diagonal. The block math is plain matmuls materializing one piece pair's
scores, so it runs wherever torch does. A fused kernel that also returns the log-sum-exp
could replace :func:`_attend` / :func:`_attend_grad` per piece pair later:
``aten._scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``) on the CPU,
``aten._scaled_dot_product_flash_attention`` / ``_efficient_attention`` or
``_scaled_dot_product_cudnn_attention`` (with ``compute_log_sumexp``) on CUDA; their
backward ops take the saved output and log-sum-exp, so the ring's backward per block
would be one call. (Their grouped-query support differs by kernel: K/V may need
``repeat_interleave`` first; the diagonal piece is ``is_causal=True``, the others unmasked.)

Rank ``r``'s position on the axis is ``comm.coord[axis]`` of :func:`current_comm`; the
ring sends to coordinate ``r+1`` and receives from ``r-1``.
"""
from __future__ import annotations

import math
import warnings
from typing import Iterator, Sequence

import torch

from autopar.device import CPU, CUDA
from autopar.ops.comm import current_comm

FORMS = ("ring", "all-gather")
LAYOUTS = ("balanced", "contiguous")

Piece = tuple[int, int]      # (first position, length): a range of positions a rank holds
CAUSAL = "causal"
"""A pair's mask when it is the square diagonal block of a causal mask (query and key
pieces the same positions): each query sees the keys up to its own. Built as a tensor only
where the pair runs as matmuls (:func:`_scores`); a fused kernel takes it as ``is_causal``."""


# --- layouts ---------------------------------------------------------------------------

def shard_pieces(seq_len: int, rank: int, c: int, layout: str = "balanced") -> list[Piece]:
    """The ranges of positions rank ``rank`` of ``c`` holds of a sequence of ``seq_len``, in
    the order its shard concatenates them."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
    parts = c if layout == "contiguous" else 2 * c
    if seq_len % parts:
        raise ValueError(f"a {layout} shard over {c} ranks cuts the sequence into {parts} "
                         f"equal chunks: {seq_len} positions do not divide")
    n = seq_len // parts
    if layout == "contiguous":
        return [(rank * n, n)]
    return [(rank * n, n), ((2 * c - 1 - rank) * n, n)]


def shard_positions(seq_len: int, rank: int, c: int, layout: str = "balanced",
                    device: torch.device | None = None) -> torch.Tensor:
    """The positions rank ``rank`` holds, in shard order (for rotary embeddings and masks)."""
    return torch.cat([torch.arange(a, a + n, device=device)
                      for a, n in shard_pieces(seq_len, rank, c, layout)])


def balanced_positions(seq_len: int, rank: int, c: int,
                       device: torch.device | None = None) -> torch.Tensor:
    """Positions of chunks ``rank`` and ``2c-1-rank`` of ``2c``: what :func:`balanced_shard`
    gives rank ``rank``."""
    return shard_positions(seq_len, rank, c, "balanced", device)


def balanced_shard(x: torch.Tensor, dim: int, rank: int, c: int) -> torch.Tensor:
    """Rank ``rank``'s balanced shard of ``x`` along ``dim``: chunks ``rank`` and
    ``2c-1-rank`` of ``2c``, concatenated."""
    shard_pieces(x.size(dim), rank, c)          # the size check
    chunks = x.chunk(2 * c, dim)
    return torch.cat([chunks[rank], chunks[2 * c - 1 - rank]], dim)


def balanced_unshard(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole tensor from every rank's :func:`balanced_shard`, in rank order."""
    halves = [p.chunk(2, dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def causal_work(seq_len: int, rank: int, c: int, layout: str = "balanced") -> int:
    """Unmasked (query, key) pairs of rank ``rank``'s queries under a causal mask (a query at
    position ``p`` sees ``p + 1`` keys): the attention work the rank does."""
    return sum(n * a + n * (n + 1) // 2 for a, n in shard_pieces(seq_len, rank, c, layout))


# --- block math ------------------------------------------------------------------------

def _pairs(q_pieces: Sequence[Piece], kv_pieces: Sequence[Piece], causal: bool,
           device: torch.device, mask5: torch.Tensor | None = None
           ) -> Iterator[tuple[slice, slice, torch.Tensor | str | None]]:
    """(query rows, key rows, mask or None) of the local tensors for every pair of pieces
    with something to compute; consecutive unmasked key pieces of one query piece merged; a
    square causal diagonal block's mask is :data:`CAUSAL`.
    ``mask5``: an explicit mask's rows for the local queries, every key position as a column
    (bool, True where a query may attend; or additive float), [B|1, Hkv|1, group|1, L, S]."""
    q0 = 0
    for qa, qn in q_pieces:
        rows, run, k0 = slice(q0, q0 + qn), None, 0
        for ka, kn in kv_pieces:
            if mask5 is not None:
                if causal and ka > qa + qn - 1:         # every key later: nothing to compute
                    k0 += kn
                    continue
                m = mask5[..., rows, ka:ka + kn]
                if causal:
                    qpos = torch.arange(qa, qa + qn, device=device)
                    kpos = torch.arange(ka, ka + kn, device=device)
                    tri = kpos[None, :] <= qpos[:, None]
                    m = (m & tri) if m.dtype == torch.bool else m.masked_fill(~tri, -math.inf)
                if m.dtype == torch.bool:
                    # a built mask's blocks (transformers' causal one): skip what it hides
                    # whole, drop it where it hides nothing
                    if not bool(m.any()):
                        k0 += kn
                        continue
                    if bool(m.all()):
                        m = None
                yield rows, slice(k0, k0 + kn), m
            elif not causal or ka + kn - 1 <= qa:        # every key visible: unmasked
                run = slice(run.start if run else k0, k0 + kn)
            else:
                if run:
                    yield rows, run, None
                    run = None
                if ka == qa and kn == qn:               # the square diagonal block
                    yield rows, slice(k0, k0 + kn), CAUSAL
                elif ka <= qa + qn - 1:                 # some visible: the diagonal
                    qpos = torch.arange(qa, qa + qn, device=device)
                    kpos = torch.arange(ka, ka + kn, device=device)
                    yield rows, slice(k0, k0 + kn), kpos[None, :] <= qpos[:, None]
            k0 += kn
        if run:
            yield rows, run, None
        q0 += qn


def _scores(q, k, scale, mask):
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is None:
        return s
    if mask is CAUSAL:
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=s.device).tril()
    return s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask


FUSED_DEVICES = (CUDA,)
"""Device types whose piece pairs run torch's fused attention kernels (forward and
backward, each taking the whole row's log-sum-exp: :func:`_flash_fwd`, :func:`_flash_bwd`;
on CUDA cuDNN's, else the flash kernel: :data:`CUDA_KERNELS`) in 16-bit without an explicit
mask; elsewhere the pairs are plain matmuls. On one H200, bf16, causal, 16k tokens, against
SDPA's own call (``benchmarks/gpu_context_block.py``, 2026-11-28): plain matmuls 52x its
forward and 27x its backward, the flash kernel 3.0x / 2.1x, cuDNN's 2.2x / 1.4x (the rest:
the merges and copies). ``"cpu"`` can be added (``_scaled_dot_product_flash_attention_for_cpu``,
fp32 too): the tests do, to check the fused path's piece logic where no GPU is."""


def _fused(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether ``q``'s pairs run the fused kernels (:data:`FUSED_DEVICES`)."""
    if mask is not None or q.device.type not in FUSED_DEVICES or q.shape[-1] > 256:
        return False
    return q.dtype in (torch.float16, torch.bfloat16) or q.device.type == CPU


CUDA_KERNELS = ["cudnn", "flash"]
"""The fused kernels a CUDA device's pairs try, in order: cuDNN's (torch's default SDPA
backend on Hopper, about twice the flash kernel's rate there: ``cost_models/gpus.py``),
then the flash kernel. A kernel that raises is dropped for the rest of the process, with a
warning (cuDNN's needs a recent cuDNN and takes some shapes only)."""


def _flash_fwd(q, k, v, causal: bool, scale: float):
    """(out, log-sum-exp [B, H, L] float32) of one piece pair, fused; q, k, v [B, H, *, D]."""
    if q.device.type == CPU:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse.float()
    while CUDA_KERNELS[0] == "cudnn":
        try:
            got = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal, False,
                scale=scale)
            return got[0], got[1].reshape(q.shape[:3]).float()
        except RuntimeError as e:
            _drop_cudnn(e)
    got = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return got[0], got[1][..., :q.shape[2]].float()


def _drop_cudnn(e: BaseException) -> None:
    if CUDA_KERNELS[0] == "cudnn":
        CUDA_KERNELS.pop(0)
        warnings.warn(f"context-parallel attention: cuDNN's fused kernel failed ({str(e).splitlines()[0][:200]}); "
                      "using the flash kernel from now on", stacklevel=3)


def _flash_bwd(do, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of one piece pair, its probabilities recomputed from ``lse`` (the whole
    row's) and its ``out`` the whole row's too: the fused backward of a block of keys."""
    if q.device.type == CPU:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, causal, scale=scale)
    while CUDA_KERNELS[0] == "cudnn":
        try:
            seed = torch.empty((), dtype=torch.int64, device=q.device)
            return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
                lse.reshape(*lse.shape, 1).contiguous(), seed, seed, None, None, None,
                q.shape[2], k.shape[2], 0.0, causal, scale=scale)[:3]
        except RuntimeError as e:
            _drop_cudnn(e)
    # dense batches: no cumulative sequence lengths (None: undefined, as the forward returns
    # them); no dropout: the RNG state is not read
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, seed,
        scale=scale)[:3]


def _aligned_causal(mask) -> bool:
    """A pair's mask is None (every key visible) or :data:`CAUSAL` (what a fused kernel's
    ``is_causal`` means); a tensor mask runs as matmuls."""
    return mask is None or mask is CAUSAL


def _heads(t: torch.Tensor, group: int) -> torch.Tensor:
    """K or V [B, Hkv, S, D] as the query heads read them [B, Hkv * group, S, D]."""
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _attend(q5, k, v, q_pieces, kv_pieces, causal, scale, out, lse, mask5=None, q=None) -> None:
    """Merge the local queries' attention to one K/V block into ``out`` / ``lse`` in place.
    ``q5``, ``out``: [B, Hkv, group, L, D]; ``lse``: [B, Hkv, group, L]; ``k``, ``v``:
    [B, Hkv, Lk, D]. ``q``: the queries [B, H, L, D] in their own dtype where the pairs may
    run fused (:func:`_fused`)."""
    k5, v5 = k.to(q5.dtype).unsqueeze(2), v.to(q5.dtype).unsqueeze(2)
    hkv, group = q5.shape[1], q5.shape[2]
    kx = vx = None
    for rows, keys, mask in _pairs(q_pieces, kv_pieces, causal, q5.device, mask5):
        if q is not None and _aligned_causal(mask):
            if kx is None:
                kx, vx = _heads(k.to(q.dtype), group), _heads(v.to(q.dtype), group)
            bout, blse = _flash_fwd(q[..., rows, :], kx[..., keys, :], vx[..., keys, :],
                                    mask is not None, scale)
            bout = bout.to(q5.dtype).unflatten(1, (hkv, group))
            blse = blse.to(q5.dtype).unflatten(1, (hkv, group))
        else:
            s = _scores(q5[..., rows, :], k5[..., keys, :], scale, mask)
            blse = s.logsumexp(-1)
            # a row with no visible key here (lse -inf) contributes nothing
            bout = torch.exp(s - blse.clamp(min=torch.finfo(s.dtype).min)[..., None]) @ v5[..., keys, :]
        o, m = out[..., rows, :], lse[..., rows]
        new = torch.logaddexp(m, blse)
        keep = torch.exp(m - new).nan_to_num(0.0)       # -inf - -inf: a row with nothing yet
        o.mul_(keep[..., None]).add_(bout * torch.exp(blse - new).nan_to_num(0.0)[..., None])
        m.copy_(new)


def _attend_grad(q5, k, v, do5, lse, delta, q_pieces, kv_pieces, causal, scale, dq, dk, dv,
                 mask5=None, fused=None) -> None:
    """Add one K/V block's share of the gradients into ``dq`` (as ``q5``) and ``dk``, ``dv``
    (as ``k``), the probabilities recomputed from the whole row's ``lse``; ``delta`` is
    rowsum(dO * O). ``fused``: (q, dout, out [B, H, L, D] in q's dtype, lse [B, H, L]
    float32) where the pairs may run fused (:func:`_fused`)."""
    k5, v5 = k.to(q5.dtype).unsqueeze(2), v.to(q5.dtype).unsqueeze(2)
    hkv, group = q5.shape[1], q5.shape[2]
    kx = vx = None
    for rows, keys, mask in _pairs(q_pieces, kv_pieces, causal, q5.device, mask5):
        if fused is not None and _aligned_causal(mask):
            q, dout, out, lse4 = fused
            if kx is None:
                kx, vx = _heads(k.to(q.dtype), group), _heads(v.to(q.dtype), group)
            dqb, dkb, dvb = _flash_bwd(dout[..., rows, :], q[..., rows, :], kx[..., keys, :],
                                       vx[..., keys, :], out[..., rows, :],
                                       lse4[..., rows].contiguous(), mask is not None, scale)
            dq[..., rows, :] += dqb.to(dq.dtype).unflatten(1, (hkv, group))
            dk[..., keys, :] += dkb.to(dk.dtype).unflatten(1, (hkv, group)).sum(2)
            dv[..., keys, :] += dvb.to(dv.dtype).unflatten(1, (hkv, group)).sum(2)
            continue
        qb, kb, vb, dob = q5[..., rows, :], k5[..., keys, :], v5[..., keys, :], do5[..., rows, :]
        p = torch.exp(_scores(qb, kb, scale, mask) - lse[..., rows, None]).nan_to_num(0.0)
        dv[..., keys, :] += (p.transpose(-1, -2) @ dob).sum(2)
        ds = p * (dob @ vb.transpose(-1, -2) - delta[..., rows, None])
        dq[..., rows, :] += scale * (ds @ kb)
        dk[..., keys, :] += scale * (ds.transpose(-1, -2) @ qb).sum(2)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores, probabilities and running sums in float32 at least."""
    return torch.promote_types(dtype, torch.float32)


# --- the autograd function -------------------------------------------------------------

class _ContextAttention(torch.autograd.Function):
    """Outputs (out [B, H, L, D] in q's dtype, log-sum-exp [B, H, L], not differentiable)."""

    @staticmethod
    def forward(q, k, v, mask, axis, form, causal, scale, layout):
        comm = current_comm()
        c, i = comm.size(axis), comm.coord[axis]
        seq = q.shape[2] * c
        hkv = k.shape[1]
        q5 = q.to(_acc_dtype(q.dtype)).unflatten(1, (hkv, -1))
        mask5 = _mask5(mask, hkv)
        out = torch.zeros_like(q5)
        lse = torch.full(q5.shape[:-1], -math.inf, dtype=q5.dtype, device=q5.device)
        mine = shard_pieces(seq, i, c, layout)
        fq = q.contiguous() if _fused(q, mask) else None
        if form == "all-gather":
            every = [p for r in range(c) for p in shard_pieces(seq, r, c, layout)]
            _attend(q5, comm.all_gather(k, axis, 2), comm.all_gather(v, axis, 2),
                    mine, every, causal, scale, out, lse, mask5, fq)
        else:
            kv = torch.stack([k, v])
            for step in range(c):
                # the next block is on its way while this one is computed
                nxt = comm.shift_start(kv, axis) if step < c - 1 else None
                _attend(q5, kv[0], kv[1], mine, shard_pieces(seq, (i - step) % c, c, layout),
                        causal, scale, out, lse, mask5, fq)
                kv = nxt.wait() if nxt is not None else None
        return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, axis, form, causal, scale, layout = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.mark_non_differentiable(lse)
        ctx.axis, ctx.form, ctx.causal, ctx.scale, ctx.layout = axis, form, causal, scale, layout
        # kept, not looked up again in backward: the autograd engine runs a CUDA tensor's
        # backward on its device thread, where the caller's current communicator is not set
        ctx.comm = current_comm()

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, mask = ctx.saved_tensors
        axis, causal, scale, comm = ctx.axis, ctx.causal, ctx.scale, ctx.comm
        c, i = comm.size(axis), comm.coord[axis]
        seq = q.shape[2] * c
        hkv, acc = k.shape[1], _acc_dtype(q.dtype)
        q5 = q.to(acc).unflatten(1, (hkv, -1))
        mask5 = _mask5(mask, hkv)
        do5 = dout.to(acc).unflatten(1, (hkv, -1))
        lse5 = lse.unflatten(1, (hkv, -1))
        delta = (do5 * out.to(acc).unflatten(1, (hkv, -1))).sum(-1)
        dq = torch.zeros_like(q5)
        mine = shard_pieces(seq, i, c, ctx.layout)
        fused = ((q.contiguous(), dout.to(q.dtype).contiguous(), out.contiguous(), lse.float().contiguous())
                 if _fused(q, mask) else None)
        if ctx.form == "all-gather":
            every = [p for r in range(c) for p in shard_pieces(seq, r, c, ctx.layout)]
            kk, vv = comm.all_gather(k, axis, 2), comm.all_gather(v, axis, 2)
            dk = torch.zeros(kk.shape, dtype=acc, device=kk.device)
            dv = torch.zeros_like(dk)
            _attend_grad(q5, kk, vv, do5, lse5, delta, mine, every, causal, scale, dq, dk, dv, mask5,
                         fused)
            dk, dv = comm.reduce_scatter(dk, axis, 2), comm.reduce_scatter(dv, axis, 2)
        else:
            kv = torch.stack([k, v])
            travelling = None   # the held block's dK, dV so far, on its way from the rank behind
            for step in range(c):
                nxt = comm.shift_start(kv, axis) if step < c - 1 else None
                part = torch.zeros(kv.shape, dtype=acc, device=kv.device)   # this rank's share
                _attend_grad(q5, kv[0], kv[1], do5, lse5, delta, mine,
                             shard_pieces(seq, (i - step) % c, c, ctx.layout),
                             causal, scale, dq, part[0], part[1], mask5, fused)
                dkv = part if travelling is None else travelling.wait() + part
                # on with the block while the next one is computed; after the last step, home
                # to its owner (tagged apart from the K/V block in flight beside it)
                travelling = comm.shift_start(dkv, axis, tag=1) if c > 1 else None
                kv = nxt.wait() if nxt is not None else None
            dkv = travelling.wait() if travelling is not None else dkv
            dk, dv = dkv[0], dkv[1]
        return (dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None, None, None, None, None, None)


def _mask5(mask: torch.Tensor | None, hkv: int) -> torch.Tensor | None:
    """An explicit mask [B|1, H|1, L, S] as [B|1, Hkv|1, group|1, L, S] (the query heads'
    grouping of :func:`_attend`); a float mask in float32 at least."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        mask = mask.to(_acc_dtype(mask.dtype))
    return mask.unsqueeze(1) if mask.shape[1] == 1 else mask.unflatten(1, (hkv, -1))


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: int, *,
                      form: str = "ring", causal: bool = True, scale: float | None = None,
                      enable_gqa: bool = False, layout: str = "balanced",
                      attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's rows of ``F.scaled_dot_product_attention(Q, K, V, is_causal=causal,
    scale=scale, enable_gqa=enable_gqa)`` over the whole sequence, given this rank's shards
    ``q`` [B, H, L, D] and ``k``, ``v`` [B, Hkv, L, D] of it along mesh axis ``axis`` of
    the current communicator, in ``layout`` (``"balanced"``: :func:`balanced_shard`;
    ``"contiguous"``: rank ``r`` holds ``[r*L, (r+1)*L)``). ``form``: ``"ring"`` or
    ``"all-gather"`` (the module's docstring). ``Hkv < H`` (grouped-query attention: query
    head ``h`` reads K/V head ``h // (H / Hkv)``) needs ``enable_gqa=True``, as SDPA does.
    ``attn_mask``: SDPA's mask (bool, True where a query may attend, or additive float)
    for this rank's query rows and every key position in sequence order, [B|1, H|1, L, S]
    (rank ``r``'s rows in the contiguous layout: the mask split on its rows as ``q`` is).
    Differentiable in ``q``, ``k`` and ``v``."""
    if form not in FORMS:
        raise ValueError(f"form={form!r}: expected one of {FORMS}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] \
            or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"expected q [B, H, L, D] and k, v [B, Hkv, L, D] (one rank's shards of "
                         f"one sequence); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    h, hkv = q.shape[1], k.shape[1]
    if h != hkv and not (enable_gqa and h % hkv == 0):
        raise ValueError(f"{h} query heads against {hkv} key/value heads: grouped-query attention "
                         "needs enable_gqa=True and a head count that divides")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if attn_mask is not None:
        if attn_mask.dim() != 4 or attn_mask.shape[2] != q.shape[2] \
                or attn_mask.shape[3] != q.shape[2] * current_comm().size(axis) \
                or attn_mask.shape[1] not in (1, h) or attn_mask.shape[0] not in (1, q.shape[0]):
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)}: expected this rank's "
                             f"query rows of the whole sequence's mask, [B|1, H|1, {q.shape[2]}, "
                             f"{q.shape[2] * current_comm().size(axis)}]")
    out, _ = _ContextAttention.apply(q, k, v, attn_mask, axis, form, causal, scale, layout)
    return out


def context_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                 *, axis: int) -> torch.Tensor:
    """``aten.scaled_dot_product_attention`` on this rank's shards of the sequence along mesh
    axis ``axis``: the local call the sharding rule gives an SDPA whose sequence is split
    there (``autopar.sharding.rules.attention``). The form and the layout are the step's
    (``StepSettings``: the plan's ``context_attention`` option; ``"balanced"`` under a
    ``context=`` pin, whose graph runs the sequence in that order, else contiguous). A mask's
    rows are the local queries', its columns every key in sequence order."""
    if dropout_p:
        raise NotImplementedError("context-parallel attention with dropout_p > 0")
    settings = current_comm().settings
    form, layout = settings.context_attention, settings.context_layout
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"{query.shape[1]} query heads against {key.shape[1]} key/value heads "
                         "without enable_gqa")
    return context_attention(query, key, value, axis, form=form, causal=bool(is_causal),
                             scale=scale, enable_gqa=key.shape[1] != query.shape[1],
                             layout=layout, attn_mask=attn_mask)
