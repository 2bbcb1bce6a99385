"""ZeRO-3 by blocks: a block's weights gathered in one collective, one block ahead.

In the rewritten program a ZeRO-3 weight is gathered (``all_gather(..., regather=True)``)
right before the op that reads it: one collective per weight and use, each waited for by
the op. This pass groups those gathers into buckets, one per block (the weights of one
repeated layer, ``transformer.h.3``, in the order the program reads them; weights outside
repeated layers make buckets of consecutive reads, and a bucket holds at most
:data:`BUCKET_BYTES` of shards), and gives each bucket one node,
``param_buckets.gather_bucket([shards], ...)``, that starts one flat all-gather of them all
(async). The gather nodes stay where they are, as ``all_gather(..., bucket=, index=)``: they
take their weight from the bucket (``ops.param_buckets``, which also gathers the bucket
again in backward with prefetch, and reduce-scatters its gradients in one collective).

A block's bucket starts where the block before it begins (the first of its gathers), so the
next block's weights travel while the current block computes, as FSDP's forward prefetch
does; at most two blocks' gathered weights are alive at once. Buckets of mixed mesh axes or
dtypes are split by them (one collective each).

Every rank runs the same program, so the collectives start in the same order everywhere.
Programs whose layers are recomputed or split into pipeline stages are left as they are (a
started gather must not cross a recomputed region or a stage boundary).
"""
from __future__ import annotations

import re

from torch.fx import GraphModule, Node

from autopar.ops import collectives
from autopar.ops.param_buckets import gather_bucket

BUCKET_BYTES = 25 * 2**20
"""The most bytes of shards (this rank's) one bucket gathers."""

_BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")


def block_of(attr: str) -> str | None:
    """The repeated layer a parameter path lies in (``"transformer.h.3"`` for
    ``"transformer.h.3.attn.c_attn.weight"``), or None."""
    m = _BLOCK.match(attr)
    return m.group(1) if m else None


def _zero3_gathers(gm: GraphModule) -> list[Node]:
    """The ZeRO-3 weight gathers (of a shard the module holds), in program order."""
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and n.target is collectives.all_gather and n.kwargs.get("regather")
            and n.kwargs.get("bucket") is None and isinstance(n.args[0], Node)
            and n.args[0].op == "get_attr" and n.users]


def _shard(gm: GraphModule, node: Node):
    obj = gm
    for part in node.target.split("."):
        obj = getattr(obj, part)
    return obj


def plan_buckets(gm: GraphModule, gathers: list[Node],
                 bucket_bytes: int = BUCKET_BYTES) -> list[list[list[Node]]]:
    """``gathers`` as blocks (runs of reads of one repeated layer, or of weights outside
    any), each block as its buckets (one mesh axis and dtype each, at most ``bucket_bytes``
    of shards; a weight read twice in a block starts a new block)."""
    blocks: list[list[Node]] = []
    key, attrs = object(), set()
    for g in gathers:
        attr = g.args[0].target
        k = block_of(attr)
        if not blocks or k != key or attr in attrs:
            blocks.append([])
            key, attrs = k, set()
        blocks[-1].append(g)
        attrs.add(attr)
    out = []
    for block in blocks:
        buckets: dict[tuple, list[list[Node]]] = {}
        order: list[list[Node]] = []
        size: dict[int, int] = {}
        for g in block:
            s = _shard(gm, g.args[0])
            kind = (g.kwargs["axis"], g.kwargs.get("dtype"), s.dtype, g.kwargs.get("amax_axes", ()))
            cur = buckets.get(kind)
            nbytes = s.numel() * s.element_size()
            if cur is None or (cur[-1] and size[id(cur[-1])] + nbytes > bucket_bytes):
                cur = buckets.setdefault(kind, [])
                cur.append([])
                order.append(cur[-1])
                size[id(cur[-1])] = 0
            cur[-1].append(g)
            size[id(cur[-1])] += nbytes
        out.append(order)
    return out


def prefetch_gathers(gm: GraphModule, bucket_bytes: int = BUCKET_BYTES) -> int:
    """Rewrite ``gm``'s ZeRO-3 gathers into per-block buckets started one block early;
    returns how many gathers now take their weight from a bucket."""
    blocks = plan_buckets(gm, _zero3_gathers(gm), bucket_bytes)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    count = 0
    for b, buckets in enumerate(blocks):
        anchor = blocks[b - 1][0][0] if b else buckets[0][0]   # where the block before begins
        for bucket in buckets:
            shards = []
            for g in bucket:
                shard = g.args[0]
                if order[shard] > order[anchor]:
                    anchor.prepend(shard)            # the get_attr moves up with its gather
                    order[shard] = order[anchor] - 0.5
                shards.append(shard)
            kw = bucket[0].kwargs
            start_kw = {"axis": kw["axis"], "dims": tuple(g.kwargs["dim"] for g in bucket),
                        "groups": tuple(g.kwargs.get("groups", 1) for g in bucket)}
            if kw.get("dtype") is not None:
                start_kw["dtype"] = kw["dtype"]
            if kw.get("amax_axes"):          # an fp8 bucket's (passes/fp8_gathers.py)
                start_kw["amax_axes"] = kw["amax_axes"]
            with gm.graph.inserting_before(anchor):
                start = gm.graph.call_function(gather_bucket, (shards,), start_kw)
            for i, g in enumerate(bucket):
                g.kwargs = {**g.kwargs, "bucket": start, "index": i}
                count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
