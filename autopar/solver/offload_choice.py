"""Keep, recompute or offload, per repeated layer: the choice the unpipelined search makes
where memory binds (``flat._with_offload``).

The search first finds the fewest layers whose recomputation fits the budget
(``flat._fewest_layers``: the set ``R``, every other layer kept). Each layer of ``R`` must
free its saved bytes, and there are two ways to: recompute it, or offload what it saves to
host memory. Under the solution's placements, for layer ``l`` with saved bytes ``S_l`` (its
nodes but those read outside it, which stay either way), forward and backward compute
``F_l`` and ``B_l``:

    recompute(l) = F_l                                   (one more forward in backward)
    offload(l)   = max(0, S_l/bw - F_l) + max(0, S_l/bw - B_l)   on a GPU
                 = 2 S_l / bw                                    on a CPU rank

(``pricing.activation_offload``: the copy out hidden by the next layer's forward, the copy
back by the backward of the layer after it; ``bw`` the host link, ``cost_models.offload``).
Each layer of ``R`` takes the cheaper (:func:`choose`); the plan with that split is solved
again (the ILP may change placements, and prices the copies and the layers in flight
exactly), and it replaces the recomputing plan only if its objective is lower and it fits.
An offloaded layer holds up to two layers' bytes on a GPU (the one whose backward runs and
the one prefetched), one more than a recomputed one; when the split does not fit, the next
kept layer is freed too, by its cheaper way, once.

So a device whose host link hides the copies (an H100's PCIe 5.0 behind a large layer's
compute) offloads; one whose link cannot recomputes. A CPU rank is never offered the choice
(``pricing.activation_offload.frees_device_memory``: its host memory is its memory, so an
offload frees nothing; where its memcpy was priced below a layer's forward, the search had
offloaded, and ``tests/test_partial_recompute.py`` saw no layer recomputed).
"""
from __future__ import annotations

from autopar.pricing.activation_offload import exposed_s


def layer_prices(problem, cost, choice: dict[str, int], members: dict[str, tuple[tuple, frozenset]],
                 device) -> dict[str, tuple[float, float, float]]:
    """Layer -> (saved bytes S_l, seconds recomputing it adds, seconds offloading it adds)
    under ``choice`` (one option per decision of ``problem``, priced by ``cost``);
    ``members``: each layer's captured nodes and those read outside it
    (``partial_recompute.layer_nodes``)."""
    var_of = {m: name for name, v in problem.vars.items() if v.kind == "op" for m in v.members}
    out = {}
    for layer, (nodes, read_outside) in members.items():
        saved = fwd = bwd = 0.0
        for x in nodes:
            name = var_of.get(x)
            if name is None:
                continue
            v = problem.vars[name]
            combo = v.options[choice[name]]
            f, b = cost.base_time(v, combo)
            fwd, bwd = fwd + f, bwd + b
            if x not in read_outside:
                saved += cost.saved_bytes(v, combo)
        out[layer] = (saved, fwd, exposed_s(saved, fwd, bwd, device))
    return out


def choose(prices: dict[str, tuple[float, float, float]], freed) -> tuple[tuple, tuple]:
    """(layers to recompute, layers to offload) of ``freed`` (graph order kept): each by the
    cheaper of its two prices (:func:`layer_prices`), recomputation on a tie."""
    rec = tuple(lay for lay in freed if prices[lay][2] >= prices[lay][1])
    off = tuple(lay for lay in freed if prices[lay][2] < prices[lay][1])
    return rec, off


__all__ = ["choose", "layer_prices"]
