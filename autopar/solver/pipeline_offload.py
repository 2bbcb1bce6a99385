"""Keep, recompute or offload, per repeated layer, in a pipeline the free search plans: the
choice the unpipelined search makes where memory binds (``flat._with_offload``), made on a
pipeline configuration's priced plan.

Where a configuration fits only by freeing layers (``pipeline_search._Cutter.fitting``: the
layers ``partial_recompute`` recomputes, per rank the fewest that fit), each freed layer is
priced as the flat search prices it (``solver.offload_choice.layer_prices``, the same
chooser ``choose``) under the stage solution's placements, on the graph captured at the
micro-batch: recomputing it costs its forward ``F_l``, offloading it the copies its
neighbours do not hide, ``max(0, S_l/bw - F_l) + max(0, S_l/bw - B_l)`` on a GPU (a CPU
rank is never offered the choice: ``activation_offload.frees_device_memory``). Both are
paid once per micro-batch (each micro-batch's forward saves its own tensors and its
backward brings them back), so the per-micro-batch comparison is the per-step one. What a
rank holds differs: a recomputed layer frees ``n_k`` micro-batches' saved bytes of its stage
``k`` and rebuilds one layer at a time; an offloaded one frees the same and holds the
offloaded layers in flight (two on a GPU) once (``pipeline_costs``: ``offload_bytes``).

The split is then planned for real on the same configuration (the stage ILP with the
offloaded layers pinned, ``offload_activations=``, and the others to recompute, or
``"none"``; the stage DP's cuts within the budget) and replaces the recomputing plan only if
it fits and the simulated schedule (``pipeline_estimate``) is faster. When it does not fit,
every repeated layer is freed, each by its cheaper way, once (where offloading them all does
not add more work than the recomputation it replaces: :func:`_every`): a rank holding an offloaded
layer holds two layers in flight (one more than a recomputed layer's rebuild), so a rank
that fitted by recomputing one or two layers may need one more freed, and which layers a
rank holds moves with the cuts the DP chooses again (the flat search frees one more kept
layer; here every rank may need one). On a GPT of hidden 16384, 8 layers, on 2 x 8 H100s
(data 8, ZeRO-3, bf16, 34 GiB a device) offloading the 6 layers recomputed did not fit,
offloading all 8 did, 1.85 s against 2.07 s recomputing 6.

Only where the user left ``offload_activations=`` and ``recompute=`` free and ``compile``
off, as the flat rule (:func:`may_offload`), and only in the free pipeline search
(``MeshAsk.weigh_offload``): a pinned ``pipeline=`` recomputes as before.
"""
from __future__ import annotations

from autopar.options import Options
from autopar.pricing.activation_offload import frees_device_memory
from autopar.solver.errors import InfeasibleError, StagesDoNotFit
from autopar.solver.offload_choice import choose, layer_prices
from autopar.solver.partial_recompute import layer_nodes
from autopar.solver.pipeline_price import pipeline_estimate


def may_offload(pins: Options, cl) -> bool:
    """Whether a pipeline plan under the user's ``pins`` on ``cl`` may offload the layers it
    frees: ``offload_activations=`` and ``recompute=`` free, not compiled, no branch
    parallelism, and a device an offload frees memory of (the flat search's rule,
    ``flat._with_fewest_layers``)."""
    return (pins.offload_activations is None and pins.recompute is None and not pins.compile
            and (pins.branch or 1) == 1 and frees_device_memory(cl.device))


def _step(cutter, fitted) -> float:
    _, pr, sp = fitted
    cuts = tuple(int(pr.bounds[c]) for c in sp.cuts)
    return pipeline_estimate(pr, cutter.config, cuts).step_time_s


def _every(prices, freed) -> list[list[str]]:
    """The retry's layers (every repeated layer), unless they are the freed ones already or
    their copies add more seconds per micro-batch, summed over the layers, than recomputing
    the freed layers does (a filter, not a bound: the copies spread over every rank where
    the recomputation sits on the ranks holding the most in flight). On the Llama 3 405B
    row of ``benchmarks/solve_time.py`` (2,048 x 8 H100s, p = 16) the 126 layers' copies
    add 0.58 s against 0.25 s for the 25 layers recomputed, and the plan offloading them
    all was 9.60 s against 6.65 s: two ILPs of the stage mesh per configuration saved."""
    every = list(prices)
    if len(freed) == len(every) or \
            sum(prices[lay][2] for lay in every) >= sum(prices[lay][1] for lay in freed):
        return []
    return [every]


def with_offload(cutter, fitted):
    """``fitted`` = ((Plan, Solved), Priced, StagePlan), a stage solution that recomputes
    layers and its cut, or the same configuration with each of those layers recomputed or
    offloaded, whichever ``offload_choice`` prices cheaper, when that fits and its step is
    predicted faster; when it does not fit, every repeated layer freed so, once (module
    docstring). ``cutter``: the configuration's ``pipeline_search._Cutter``."""
    (plan, solved), _, _ = fitted
    members = layer_nodes(cutter.cap)
    freed = [lay for lay in plan.recompute if lay in members]
    if not freed:
        return fitted
    prices = layer_prices(solved.problem, solved.cost, solved.choice, members, cutter.cl.device)
    got = None
    for layers in (freed, *_every(prices, freed)):
        rec, off = choose(prices, layers)
        if not off:
            break
        try:
            again = cutter.solve(cutter.pins.replace(offload_activations=off, recompute=rec or "none"),
                                 explain=False)
            got = (again, *cutter.cut(again, explain=False))
            break
        except (StagesDoNotFit, InfeasibleError) as e:
            if cutter.ask.verbose:
                print(f"pipeline {cutter.config}: offloading {len(off)} layers, recomputing "
                      f"{len(rec)}, does not fit: {str(e).splitlines()[0][:100]}")
    if got is None:
        return fitted
    if cutter.ask.verbose:
        print(f"pipeline {cutter.config}: recompute {len(got[0][0].recompute)}, offload "
              f"{len(off)} layers: {_step(cutter, got) * 1e3:.3f} ms; recomputing "
              f"{len(freed)}: {_step(cutter, fitted) * 1e3:.3f} ms")
    return got if _step(cutter, got) < _step(cutter, fitted) else fitted


__all__ = ["may_offload", "with_offload"]
