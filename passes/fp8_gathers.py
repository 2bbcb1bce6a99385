"""ZeRO-3's fp8 all-gather: a tensorwise fp8 linear's weight gathered in float8.

Under ``precision="fp8"``, the tensorwise recipe and ``zero=3`` (``Options.fp8_gathers``),
each ZeRO-3 weight gather that feeds one fp8 linear alone (``all_gather(shard, ...,
regather=True)`` of a stored shard, read by that ``fp8_linear`` and nothing else) gathers
the weight in ``float8_e4m3fn`` instead of bf16, as torchao's FSDP2 float8 all-gather
(``enable_fsdp_float8_all_gather``) does: each rank casts its shard with the whole weight's
scale (its amax: one max-reduction of the shards' amaxes over the gather's axis, and over
the mesh axes the weight stays split on at the linear, tensor parallelism's), the fp8 bytes
are gathered (1 byte an element, half of bf16's), and the linear's GEMMs read the gathered
fp8 weight as it is (``fp8_linear(..., w_fp8=True)``; ``ops.fp8.fp8_weight``). The tensorwise
cast is elementwise with one scale, so casting the shards equals casting the gathered
weight bit for bit; backward's dgrad reads the same fp8 weight (the recipe's cast of W
again gives those values), gathered again in fp8 with forward's scale; the weight's
gradient is reduce-scattered as before. Rowwise scales W per row in forward and per column
in backward: a shard's cast is not the whole weight's on the split dim, and torchao gathers
rowwise weights in bf16; so does autopar. A gather with another reader, or a chain of
gathers (a weight split over two data axes), stays bf16.
"""
from __future__ import annotations

from torch.fx import GraphModule, Node

from autopar.ops import collectives
from autopar.ops.fp8 import E4M3, fp8_linear


def _fp8_gather_of(n: Node) -> Node | None:
    """The ZeRO-3 gather that is tensorwise fp8 linear ``n``'s weight and read by ``n``
    alone, or None."""
    if n.kwargs.get("scaling") != "tensorwise":
        return None
    w = n.args[1] if len(n.args) > 1 else None
    if (not isinstance(w, Node) or w.op != "call_function" or w.target is not collectives.all_gather
            or not w.kwargs.get("regather") or w.kwargs.get("bucket") is not None
            or len(w.users) != 1 or not isinstance(w.args[0], Node) or w.args[0].op != "get_attr"):
        return None
    return w


def fp8_weight_gathers(gm: GraphModule) -> list[str]:
    """Rewrite ``gm``'s ZeRO-3 gathers of tensorwise fp8 linears' weights into fp8 gathers
    (module docstring), in place; returns the gather nodes changed."""
    changed = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not fp8_linear:
            continue
        g = _fp8_gather_of(n)
        if g is None:
            continue
        axis = g.kwargs["axis"]
        others = tuple(sorted({a for a, _ in n.kwargs.get("w_shards", ()) if a != axis}))
        g.kwargs = {**g.kwargs, "dtype": E4M3, "amax_axes": others}
        n.kwargs = {**n.kwargs, "w_fp8": True}
        changed.append(g.name)
    if changed:
        gm.recompile()
    return changed

