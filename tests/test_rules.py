"""Every sharding rule against the op on one device, forward and backward.

Hypothesis draws the shapes (small: dims of 2..8, mostly multiples of 4 so that shards
divide) and a mesh from {(2,), (4,), (2, 2)}; every strategy combination on a 1-D mesh, a
drawn subset on (2, 2), runs through ``check_strategy`` on simulated ranks. A case that is
known not to match sits in ``XFAIL`` with its reason.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from autopar.placement import Partial, Replicate, Shard
from autopar.ops import collectives, local_ops
from autopar.ops.comm import ThreadWorld
from autopar.sharding.check import call_from_tensors, check_strategy
from autopar.sharding.registry import Strategy, axis_strategies, mesh_strategies

aten = torch.ops.aten
R, P = Replicate(), Partial()
MESHES = [(2,), (4,), (2, 2)]
MAX_COMBOS_2D = 6


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(draw, *shape):
    seed = draw(st.integers(0, 2**16))
    return torch.randn(*shape, generator=gen(seed), dtype=torch.float64)


def randint(draw, high, *shape):
    seed = draw(st.integers(0, 2**16))
    return torch.randint(0, high, shape, generator=gen(seed))


def size(draw, choices=(4, 8)):
    return draw(st.sampled_from(choices))


def shape(draw, ndim, choices=(4, 8)):
    return [size(draw, choices) for _ in range(ndim)]


# --- cases: name -> draw -> (op, args, kwargs[, no_grad]) ---------------------------------

CASES = {}


def case(name, variants=1, examples=3):
    """Register a case: ``fn(draw, v)`` builds variant ``v`` (one op or argument form) of
    ``variants``; each variant runs ``examples`` hypothesis examples."""
    def deco(fn):
        for v in range(variants):
            CASES[f"{name}-{v}" if variants > 1 else name] = (fn, v, examples)
        return fn
    return deco


def pick(v, options):
    """Variant ``v`` of a case's options."""
    return options[v % len(options)]


def _bcast_like(draw, s):
    """A shape that broadcasts against ``s``: some leading dims dropped, some dims 1."""
    lead = draw(st.integers(0, len(s) - 1))
    return [1 if draw(st.booleans()) else n for n in s[lead:]]


# pointwise

@case("binary_broadcast", 6, 4)
def _(draw, v):
    op = pick(v, [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
                  aten.maximum.default, aten.pow.Tensor_Tensor])
    s = shape(draw, draw(st.integers(1, 3)))
    a, b = randn(draw, *s), randn(draw, *_bcast_like(draw, s))
    if draw(st.booleans()):
        a, b = b, a
    if op in (aten.div.Tensor, aten.pow.Tensor_Tensor):
        a, b = a.abs() + 0.5, b.abs() + 0.5
    return op, (a, b), {}


@case("binary_scalar", 7, 2)
def _(draw, v):
    op = pick(v, [aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
                  aten.rsub.Scalar, aten.add.Scalar, aten.mul.Scalar])
    return op, (randn(draw, *shape(draw, 2)), draw(st.sampled_from([2.0, -0.5]))), {}


UNARY = [aten.neg.default, aten.exp.default, aten.log.default, aten.sqrt.default,
         aten.rsqrt.default, aten.reciprocal.default, aten.sin.default, aten.cos.default,
         aten.tanh.default, aten.sigmoid.default, aten.relu.default, aten.silu.default,
         aten.gelu.default, aten.clone.default, aten.contiguous.default, aten.abs.default,
         aten.erf.default, aten.ones_like.default, aten.zeros_like.default]


@case("unary", len(UNARY), 2)
def _(draw, v):
    op = UNARY[v]
    return op, (randn(draw, *shape(draw, draw(st.integers(1, 3)))).abs() + 0.5,), {}


@case("unary_args", 9, 2)
def _(draw, v):
    x = randn(draw, *shape(draw, 3)).abs() + 0.5
    return pick(v, [
        (aten.pow.Tensor_Scalar, (x, 2.0), {}),
        (aten.gelu.default, (x,), {"approximate": "tanh"}),
        (aten.to.dtype, (x, torch.float32), {}),
        (aten._to_copy.default, (x,), {"dtype": torch.float32}),
        (aten.type_as.default, (x, x.float()), {}),
        (aten.dropout.default, (x, 0.0, True), {}),
        (aten.dropout.default, (x, 0.5, False), {}),
        (aten.full_like.default, (x, 3.0), {}),
        (aten.clamp.default, (x, 0.6, 1.2), {}),
    ])


@case("where_masked_fill", 3, 3)
def _(draw, v):
    s = shape(draw, 3)
    x = randn(draw, *s)
    m = randn(draw, *_bcast_like(draw, s)) > 0
    return pick(v, [
        (aten.where.self, (m, x, randn(draw, *_bcast_like(draw, s))), {}),
        (aten.masked_fill.Scalar, (x, m, 0.0), {}),
        (aten.masked_fill.Scalar, (x, m, -1e4), {}),
    ])


# matmul

@case("linear", 1, 10)
def _(draw, v):
    s = shape(draw, draw(st.integers(1, 3)))
    n = size(draw)
    args = (randn(draw, *s), randn(draw, n, s[-1]))
    if draw(st.booleans()):
        args += (randn(draw, n),)
    return aten.linear.default, args, {}


@case("mm_bmm_addmm", 6, 3)
def _(draw, v):
    b, m, k, n = shape(draw, 4)
    return pick(v, [
        (aten.mm.default, (randn(draw, m, k), randn(draw, k, n)), {}),
        (aten.bmm.default, (randn(draw, b, m, k), randn(draw, b, k, n)), {}),
        (aten.addmm.default, (randn(draw, n), randn(draw, m, k), randn(draw, k, n)), {}),
        (aten.addmm.default, (randn(draw, m, n), randn(draw, m, k), randn(draw, k, n)),
         {"beta": 0.5, "alpha": 2.0}),
        (aten.baddbmm.default, (randn(draw, b, 1, n), randn(draw, b, m, k),
                                randn(draw, b, k, n)), {}),
        (aten.einsum.default, ("bmk,kn->bmn", [randn(draw, b, m, k), randn(draw, k, n)]), {}),
    ])


@case("matmul", 1, 12)
def _(draw, v):
    na, nb = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    batch = shape(draw, 2)
    m, k, n = shape(draw, 3)

    def batch_dims(nd):
        return [1 if draw(st.booleans()) else b for b in batch[len(batch) - (nd - 2):]]
    sa = batch_dims(na) + [m, k] if na >= 2 else [k]
    sb = batch_dims(nb) + [k, n] if nb >= 2 else [k]
    return aten.matmul.default, (randn(draw, *sa), randn(draw, *sb)), {}


# reductions

@case("sum_mean", 4, 5)
def _(draw, v):
    nd = draw(st.integers(1, 3))
    x = randn(draw, *shape(draw, nd))
    dims = draw(st.lists(st.integers(-nd, nd - 1), min_size=1, max_size=nd,
                         unique_by=lambda d: d % nd))
    keep = draw(st.booleans())
    return pick(v, [
        (aten.sum.dim_IntList, (x, dims, keep), {}),
        (aten.mean.dim, (x, dims, keep), {}),
        (aten.sum.default, (x,), {}),
        (aten.mean.default, (x,), {}),
    ])


@case("reductions_other", 8, 3)
def _(draw, v):
    x = randn(draw, *shape(draw, 3))
    d = draw(st.integers(-3, 2))
    keep = draw(st.booleans())
    return pick(v, [
        (aten.amax.default, (x, [d], keep), {}),
        (aten.max.dim, (x, d, keep), {}),
        (aten.argmax.default, (x, d, keep), {}),
        (aten.var.correction, (x, [d]), {"correction": 1, "keepdim": keep}),
        (aten.std.dim, (x, [d], True, keep), {}),
        (aten.logsumexp.default, (x, [d], keep), {}),
        (aten.cumsum.default, (x, d), {}),
        (aten.linalg_vector_norm.default, (x, 2.0, [d], keep), {}),
    ])


# norms

@case("layer_rms_group_norm", 4, 3)
def _(draw, v):
    s = shape(draw, 3)
    x = randn(draw, *s)
    return pick(v, [
        (aten.layer_norm.default, (x, s[-1:], randn(draw, s[-1]), randn(draw, s[-1])), {}),
        (aten.layer_norm.default, (x, s[-2:]), {}),
        (aten.rms_norm.default, (x, s[-1:], randn(draw, s[-1])), {}),
        (aten.group_norm.default, (x, 2, randn(draw, s[1]), randn(draw, s[1])), {}),
    ])


@case("batch_norm", 1, 4)
def _(draw, v):
    n, c, h, w = shape(draw, 4, (2, 4))
    training = draw(st.booleans())
    args = (randn(draw, n, c, h, w), randn(draw, c), randn(draw, c),
            randn(draw, c).abs(), randn(draw, c).abs() + 0.5, training, 0.1, 1e-5, False)
    return aten.batch_norm.default, args, {}, (3, 4)


# attention

@case("softmax", 3, 3)
def _(draw, v):
    x = randn(draw, *shape(draw, 3))
    d = draw(st.integers(-3, 2))
    return pick(v, [
        (aten.softmax.int, (x, d), {}), (aten.log_softmax.int, (x, d), {}),
        (aten._softmax.default, (x, d, False), {}),
    ])


@case("sdpa", 3, 5)
def _(draw, v):
    b, h, lq, e = shape(draw, 4)
    s = draw(st.sampled_from([lq, 4]))
    hkv = draw(st.sampled_from([h, h // 2]))
    q, k, val = randn(draw, b, h, lq, e), randn(draw, b, hkv, s, e), randn(draw, b, hkv, s, e)
    kwargs = {"enable_gqa": True} if hkv != h else {}
    args = (q, k, val)
    kind = pick(v, ["causal", "mask", "plain"])
    if kind == "causal" and s == lq:
        kwargs["is_causal"] = True
    elif kind == "mask":
        mshape = draw(st.sampled_from([[lq, s], [b, 1, lq, s], [1, h, lq, s], [b, h, lq, s]]))
        args += (randn(draw, *mshape),)
    return aten.scaled_dot_product_attention.default, args, kwargs


# conv

@case("conv", 1, 5)
def _(draw, v):
    n, cin, cout = shape(draw, 3)
    hw = draw(st.sampled_from([4, 6]))
    x = randn(draw, n, cin, hw, hw)
    w = randn(draw, cout, cin, 3, 3)
    bias = randn(draw, cout) if draw(st.booleans()) else None
    return aten.conv2d.default, (x, w, bias, [1, 1], [draw(st.integers(0, 1))] * 2), {}


@case("pool", 4, 2)
def _(draw, v):
    x = randn(draw, *shape(draw, 2), 4, 4)
    return pick(v, [
        (aten.max_pool2d.default, (x, [2, 2]), {}),
        (aten.avg_pool2d.default, (x, [2, 2]), {}),
        (aten.adaptive_avg_pool2d.default, (x, [1, 1]), {}),
        (aten.conv1d.default, (x[:, :, 0], randn(draw, 4, x.shape[1], 3)), {}),
    ])


# views

@case("view_reshape", 8, 3)
def _(draw, v):
    a, b, c = shape(draw, 3)
    x = randn(draw, a, b, c)
    out = pick(v, [
        [a * b, c], [a, b * c], [a * b * c], [a, 2, b // 2, c], [2, a // 2, b * c],
        [a, c, b], [a * b // 4, 4 * c], [1, a, b, c],
    ])
    op = pick(v, [aten.view.default, aten.reshape.default, aten._unsafe_view.default])
    if draw(st.booleans()):
        out = list(out)
        out[draw(st.integers(0, len(out) - 1))] = -1
    return op, (x, out), {}


@case("flatten_unflatten_squeeze", 7, 2)
def _(draw, v):
    a, b, c = shape(draw, 3)
    x = randn(draw, a, b, c)
    return pick(v, [
        (aten.flatten.using_ints, (x, 1), {}),
        (aten.flatten.using_ints, (x, 0, 1), {}),
        (aten.unflatten.int, (x, 1, [2, b // 2]), {}),
        (aten.unflatten.int, (x, -1, [-1, 2]), {}),
        (aten.unsqueeze.default, (x, draw(st.integers(-4, 3))), {}),
        (aten.squeeze.dim, (x[:, :1], 1), {}),
        (aten.squeeze.dims, (x[:, :1, None], [1, 2]), {}),
    ])


@case("expand", 2, 5)
def _(draw, v):
    s = shape(draw, 3)
    src = _bcast_like(draw, s)
    x = randn(draw, *src)
    size_ = [n if draw(st.booleans()) or i < len(s) - len(src) else -1 for i, n in enumerate(s)]
    return pick(v, [
        (aten.expand.default, (x, size_), {}),
        (aten.expand_as.default, (x, randn(draw, *s)), {}),
    ])


@case("permute_transpose", 4, 3)
def _(draw, v):
    x = randn(draw, *shape(draw, 3))
    return pick(v, [
        (aten.permute.default, (x, draw(st.permutations([0, 1, 2]))), {}),
        (aten.transpose.int, (x, draw(st.integers(-3, 2)), draw(st.integers(-3, 2))), {}),
        (aten.t.default, (x[0],), {}),
        (aten.mT.default, (x,), {}),
    ])


@case("split_cat_stack", 6, 3)
def _(draw, v):
    s = shape(draw, 3)
    x = randn(draw, *s)
    d = draw(st.integers(0, 2))
    return pick(v, [
        (aten.split.Tensor, (x, 2, d), {}),
        (aten.split_with_sizes.default, (x, [s[d] - 2, 2], d), {}),
        (aten.chunk.default, (x, 2, d), {}),
        (aten.unbind.int, (x[:2], 0), {}),
        (aten.cat.default, ([x, randn(draw, *s)], d), {}),
        (aten.stack.default, ([x, randn(draw, *s)], d), {}),
    ])


@case("slice_select", 6, 3)
def _(draw, v):
    s = shape(draw, 3)
    x = randn(draw, *s)
    d = draw(st.integers(-3, 2))
    return pick(v, [
        (aten.slice.Tensor, (x, d, 0, 2), {}),
        (aten.slice.Tensor, (x, d, 2, 9223372036854775807), {}),
        (aten.slice.Tensor, (x, d, 0, 9223372036854775807), {}),
        (aten.slice.Tensor, (x, d), {}),
        (aten.select.int, (x, d, 1), {}),
        (aten.narrow.default, (x, d, 1, 2), {}),
    ])


@case("index", 5, 3)
def _(draw, v):
    a, b, c = shape(draw, 3)
    x = randn(draw, a, b, c)
    i = randint(draw, b, *shape(draw, draw(st.integers(1, 2))))
    j = randint(draw, a, *i.shape)
    return pick(v, [
        (aten.index.Tensor, (x[0], [i.remainder(x.shape[1])]), {}),
        (aten.index.Tensor, (x, [None, i]), {}),
        (aten.index.Tensor, (x, [j, i]), {}),
        (aten.index.Tensor, (x, [j.remainder(a), None, i.remainder(c)]), {}),
        (aten.index_select.default, (x, 1, i.flatten()), {}),
    ])


@case("repeat", 5, 2)
def _(draw, v):
    x = randn(draw, *shape(draw, 3))
    return pick(v, [
        (aten.repeat_interleave.self_int, (x, 2, draw(st.integers(0, 2))), {}),
        (aten.repeat.default, (x, [1, 2, 1]), {}),
        (aten.flip.default, (x, [1]), {}),
        (aten.tril.default, (x,), {}),
        (aten.constant_pad_nd.default, (x, [1, 1]), {}),
    ])


# embedding, losses, misc

@case("embedding", 1, 6)
def _(draw, v):
    vocab, h = shape(draw, 2)
    idx = randint(draw, vocab, *shape(draw, draw(st.integers(1, 2))))
    pad = draw(st.sampled_from([-1, 0, vocab - 1]))
    return aten.embedding.default, (randn(draw, vocab, h), idx, pad), {}


def _targets(draw, c, *s, ignore=-100):
    t = randint(draw, c, *s)
    if draw(st.booleans()):
        t.view(-1)[0] = ignore
    return t


@case("cross_entropy", 5, 5)
def _(draw, v):
    n, c = shape(draw, 2)
    reduction = draw(st.integers(0, 2))
    spatial = draw(st.booleans())
    x = randn(draw, n, c, 4) if spatial else randn(draw, n, c)
    t = _targets(draw, c, *((n, 4) if spatial else (n,)))
    kind = pick(v, ["plain", "weight", "smoothing", "soft", "nll"])
    if kind == "weight":
        return aten.cross_entropy_loss.default, (x, t, randn(draw, c).abs(), reduction), {}, (2,)
    if kind == "smoothing":
        return aten.cross_entropy_loss.default, (x, t, None, reduction, -100, 0.1), {}
    if kind == "soft":
        return aten.cross_entropy_loss.default, (x, torch.softmax(randn(draw, *x.shape), 1),
                                                 None, reduction), {}
    if kind == "nll":
        return aten.nll_loss_nd.default, (x.log_softmax(1), t, None, reduction, -100), {}
    return aten.cross_entropy_loss.default, (x, t, None, reduction), {}


@case("pointwise_losses", 4, 3)
def _(draw, v):
    s = shape(draw, 2)
    op = pick(v, [aten.mse_loss.default, aten.l1_loss.default,
                  aten.smooth_l1_loss.default, aten.huber_loss.default])
    return op, (randn(draw, *s), randn(draw, *s), draw(st.integers(0, 2))), {}


@case("misc", 4, 2)
def _(draw, v):
    x = randn(draw, *shape(draw, 3))
    return pick(v, [
        (aten._assert_tensor_metadata.default, (x,), {"dtype": torch.float64}),
        (aten.topk.default, (x, 2), {}),
        (aten.sort.default, (x, 1), {}),
        (aten.one_hot.default, (randint(draw, 4, *x.shape[:2]), 4), {}),
    ])


# --- the sweep ----------------------------------------------------------------------------

# Known mismatches, each with its reason (strict: a fix must remove the entry).
XFAIL = {
    "dropout_p>0": "dropout with p > 0 draws its mask per rank (and the single-device "
                   "reference draws another): equal in distribution, not in value",
}


def _run_case(data, build):
    out = build(data.draw)
    op, args, kwargs = out[:3]
    no_grad = out[3] if len(out) > 3 else ()
    mesh = data.draw(st.sampled_from(MESHES), label="mesh")
    call, _ = call_from_tensors(op, args, kwargs)
    combos = mesh_strategies(call, mesh)
    if len(mesh) > 1 and len(combos) > MAX_COMBOS_2D:
        picks = data.draw(st.lists(st.integers(0, len(combos) - 1), min_size=MAX_COMBOS_2D,
                                   max_size=MAX_COMBOS_2D, unique=True), label="combos")
        combos = [combos[i] for i in picks]
    for combo in combos:
        check_strategy(op, args, kwargs, combo, mesh, no_grad=no_grad)
    return call


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_matches_single_device(name):
    build, v, examples = CASES[name]

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate],   # no shrinking: fail fast
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data):
        _run_case(data, lambda draw: build(draw, v))
    run()


# Ops whose rule must offer something besides all-Replicate for typical shapes.
@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_offers_sharding(name):
    @settings(max_examples=3, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def inner(data):
        build, v, _ = CASES[name]
        out = build(data.draw, v)
        call, _ = call_from_tensors(*out[:3])
        assert len(axis_strategies(call)) > 1, f"{call.op} offers only Replicate"
    inner()


@pytest.mark.xfail(strict=True, reason=XFAIL["dropout_p>0"])
def test_dropout_train_differs_per_rank():
    x = torch.randn(8, 8, dtype=torch.float64)
    args = (x, 0.5, True)
    call, _ = call_from_tensors(aten.dropout.default, args)
    combo = (Strategy((Shard(0),), (Shard(0),)),)
    check_strategy(aten.dropout.default, args, {}, combo, (2,))


# --- vocabulary parallelism, end to end -----------------------------------------------------

@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_vocab_parallel_embedding_and_cross_entropy(mesh):
    """Tied embedding / lm_head with the vocabulary sharded over every mesh axis:
    lookup (Partial, then all-reduced), logits sharded on the vocabulary, vocabulary-
    parallel cross-entropy; the loss and the weight's gradient equal one device's."""
    torch.manual_seed(0)
    v, h, n = 16, 4, 6
    w = torch.randn(v, h, dtype=torch.float64)
    idx = torch.randint(0, v, (2, n))
    tgt = torch.randint(0, v, (2 * n,))
    tgt[3] = -100

    ref_w = w.clone().requires_grad_()
    logits = aten.embedding.default(ref_w, idx).tanh() @ ref_w.t()
    ref = aten.cross_entropy_loss.default(logits.view(-1, v), tgt, None, 1, -100)
    ref.backward()

    axes = tuple(range(len(mesh)))
    shards = 1
    for k in mesh:
        shards *= k

    def body(comm):
        local_w = w.chunk(shards, 0)[sum(comm.coord[a] * _inner(mesh, a) for a in axes)]
        local_w = local_w.clone().requires_grad_()
        x = local_ops.vocab_parallel_embedding(local_w, idx, axes=axes)   # P
        for a in axes:
            x = collectives.all_reduce(x, a, grad_partial=True)          # -> R
        local_logits = x.tanh() @ local_w.t()                             # S(-1)
        loss = local_ops.sharded_cross_entropy(local_logits.view(-1, v // shards), tgt,
                                               None, 1, -100, class_axes=axes)
        loss.backward()
        return loss.detach(), local_w.grad, comm.coord

    for loss, grad, coord in ThreadWorld(mesh).run(body):
        torch.testing.assert_close(loss, ref.detach())
        block = sum(coord[a] * _inner(mesh, a) for a in axes)
        torch.testing.assert_close(grad, ref_w.grad.chunk(shards, 0)[block],
                                   msg=lambda m: f"weight gradient on {coord}: {m}")


def _inner(mesh, a):
    out = 1
    for k in mesh[a + 1:]:
        out *= k
    return out


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_cross_entropy_class_and_batch_sharded(mesh, reduction):
    """Every combination of class-sharded, batch-sharded and replicated over the axes."""
    torch.manual_seed(1)
    x = torch.randn(8, 8, dtype=torch.float64)
    t = torch.randint(0, 8, (8,))
    t[2] = -100
    op = aten.cross_entropy_loss.default
    args = (x, t, None, reduction)
    call, _ = call_from_tensors(op, args)
    combos = mesh_strategies(call, mesh)
    assert any(s.inputs[0] == Shard(1) for c in combos for s in c)
    for combo in combos:
        check_strategy(op, args, {}, combo, mesh)


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_vocab_parallel_embedding_rule(mesh):
    torch.manual_seed(2)
    w = torch.randn(8, 4, dtype=torch.float64)
    idx = torch.randint(0, 8, (4, 4))
    op = aten.embedding.default
    combo = tuple(Strategy((Shard(0), R), (P,)) for _ in mesh)
    check_strategy(op, (w, idx, 3), {}, combo, mesh)
