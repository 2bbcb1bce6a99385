"""The ``stage_split="even-layers"`` pin: a pipeline cut as Megatron-LM and torchtitan cut it.

Megatron-LM gives each pipeline stage ``num_layers / p`` transformer layers (each virtual
stage ``num_layers / (p v)`` under interleaving), the embedding to the first stage and the
final norm, output layer and loss to the last (``megatron/core/transformer/transformer_block.py``,
``get_num_layers_to_build``; it asserts ``num_layers % p == 0``); torchtitan's
``pipeline_module_split`` / ``generate_split_points`` splits its layers evenly the same way.
The stage DP (``autopar.solver.stage_dp``) balances the stages instead, cutting mid-layer to
absorb the output layer: a plan of a published run that used the even split is priced as
it ran only under this pin.

The repeated layers are ``autopar.analysis.layers.repeated_layers`` (the blocks of every
container of two or more, in graph order); a layer's first node on the DP's chain
(``autopar.analysis.stages.chain``) is where a stage holding it starts.
"""
from __future__ import annotations

from autopar.analysis.layers import repeated_layers
from autopar.analysis.stages import chain
from autopar.capture import Captured
from autopar.errors import PinError


def block_starts(cap: Captured) -> list[int]:
    """Chain position of each repeated layer's first node, in chain order. PinError when
    the graph has no repeated layers."""
    units = chain(cap)
    at = {name: k for k, name in enumerate(units)}
    starts = sorted(min(at[m] for m in members if m in at)
                    for members in repeated_layers(cap.gm).values() if any(m in at for m in members))
    if not starts:
        raise PinError("stage_split='even-layers' puts the same number of repeated layers on "
                       "every stage, but this model has none (an nn.ModuleList / nn.Sequential "
                       "of two or more blocks): use stage_split='balanced'")
    return starts


def even_cuts(starts: list[int], n_stages: int, virtual: int = 1) -> tuple[int, ...]:
    """The chain positions where stages 1 .. S-1 (S = ``n_stages * virtual``) begin: stage
    k's first layer is layer k * n / S of the n layers starting at ``starts``. PinError
    naming the counts when n is not a multiple of S."""
    n, S = len(starts), n_stages * virtual
    if n % S:
        stages = f"{n_stages} stages x {virtual} virtual = {S}" if virtual > 1 else f"{S} stages"
        fit = [s for s in range(1, n + 1) if n % s == 0]
        raise PinError(f"stage_split='even-layers': {n} repeated layers do not divide evenly "
                       f"over {stages} (Megatron-LM requires num_layers % stages == 0); use "
                       f"stages in all (pipeline x virtual_stages) among {fit}, or "
                       "stage_split='balanced'")
    per = n // S
    return tuple(starts[k * per] for k in range(1, S))
