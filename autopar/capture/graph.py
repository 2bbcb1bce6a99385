"""The captured graph: what ``capture`` returns and every later step reads, with the
helpers that name its parts (``fingerprint``, ``layer_of``)."""
from __future__ import annotations

import functools
import hashlib
import re
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from autopar.errors import AutoparInputError


class CaptureError(AutoparInputError, RuntimeError):
    """The model could not be captured as a graph."""


@dataclass
class Captured:
    """A captured training graph and the names around it.

    ``gm`` is the lifted graph: parameters, buffers, then user inputs are placeholders.
    """
    gm: torch.fx.GraphModule
    params: dict[str, list[str]]       # placeholder -> parameter names in the model (aliases)
    buffers: dict[str, str]            # placeholder -> buffer name in the model
    inputs: list[str]                  # placeholders of the user inputs, then the target
    n_model_inputs: int
    loss: str                          # name of the node holding the loss
    output: list[str]                  # names of the nodes the model returns
    output_spec: Any                   # pytree spec of the model's output
    has_loss: bool                     # the graph computes a scalar loss (ours or the model's)
    takes_target: bool                 # the last input is the loss's target
    method: str = "torch.export"
    microbatch_loss: Any = None
    sequence_balanced: int | None = None
    """Set when the token stream runs in the causally balanced order of this many context
    ranks (``autopar.capture.sequence_layout``)."""
    """Set when the graph was captured at micro-batch size and its loss rewritten into
    partial terms (``autopar.analysis.microbatch_loss.MicrobatchLoss``: the scale inputs and
    how to compute them from the global batch)."""

    def node(self, name: str) -> torch.fx.Node:
        return self._by_name[name]

    def __post_init__(self):
        self._by_name = {n.name: n for n in self.gm.graph.nodes}

    @property
    def model_output_spec(self) -> Any:
        """The pytree spec of the model's own output (the captured wrapper returns
        ``(loss, model_output)``)."""
        spec = self.output_spec
        return spec.child(1) if spec is not None and spec.num_children == 2 else spec

    @property
    def placeholder_names(self) -> list[str]:
        return [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]

    @functools.cached_property
    def native_dtypes(self) -> bool:
        """The floating parameters were captured in 16 bits (a model cast with
        ``.to(torch.bfloat16)``, as FSDP2's ``param_dtype`` runs it): the graph's dtypes are the
        ones the run computes in, its explicit fp32 (a norm's statistics, a loss's upcast)
        included. Captured in fp32, mixed precision is the ``precision`` pin's to price."""
        dtypes = {n.meta["val"].dtype for n in self.gm.graph.nodes
                  if n.op == "placeholder" and n.name in self.params
                  and getattr(n.meta.get("val"), "dtype", torch.int64).is_floating_point}
        return bool(dtypes) and all(d.itemsize == 2 for d in dtypes)


def _strip(name: str) -> str:
    return re.sub(r"^model\.", "", name)


_PER_GRAPH: "weakref.WeakKeyDictionary[torch.fx.Graph, dict]" = weakref.WeakKeyDictionary()
"""Per graph alive, what :func:`fingerprint` and :func:`op_names` worked out: a search
makes a plan per program it solves (tens of thousands of nodes each on a frontier model),
and a captured graph is not rewritten once captured (passes make new modules), so both
are the graph's for its life. The node count is part of the key: a graph still being
rewritten (a capture's own passes) is worked out again."""


def _per_graph(graph: torch.fx.Graph, what: str, make):
    memo = _PER_GRAPH.setdefault(graph, {})
    key = (what, len(graph.nodes))
    if key not in memo:
        memo[key] = make()
    return memo[key]


def fingerprint(cap: Captured) -> str:
    """A short hash of the graph's nodes, ops and shapes: a plan is valid for this graph only."""
    def make() -> str:
        h = hashlib.sha256()
        for n in cap.gm.graph.nodes:
            val = n.meta.get("val")
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
            h.update(f"{n.name}|{n.op}|{n.target}|{shape}\n".encode())
        return h.hexdigest()[:16]
    return _per_graph(cap.gm.graph, "fingerprint", make)


def op_names(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Each call_function node's name -> its op as text (``"aten.mm.default"``), in graph
    order (``str`` of an OpOverload formats it anew each time)."""
    return _per_graph(gm.graph, "ops", lambda: {n.name: str(n.target) for n in gm.graph.nodes
                                                if n.op == "call_function"})


def layer_of(node: torch.fx.Node) -> tuple[str, int] | None:
    """(container path, index) of the repeated layer a node belongs to, e.g. ("h", 3) for a
    node inside ``model.h[3]``; None outside repeated layers.

    A module called several times in one forward (ALBERT's one layer, run once per depth)
    is repeated too: each call a layer, (its path, the call's number from 0), e.g.
    ``("albert.encoder.albert_layer_groups.0", 1)`` for the second call, which torch.export
    marks by a key ending in ``@1``. Only modules whose every call runs two ops or more and
    reads a parameter count (a shared embedding looked up twice is not a layer, nor is a
    rotary embedding's table worked out once per attention kind from a buffer: Gemma 3's
    ``rotary_emb``, called for its sliding-window and its global layers)."""
    stack = node.meta.get("nn_module_stack") or {}
    shared = _called_again(node.graph) if node.graph is not None else {}
    for key, (path, _) in stack.items():
        base = key.split("@")[0]
        if base in shared:
            return _strip(path), int(key.split("@")[1]) if "@" in key else 0
        m = re.match(r"^(.*?)\.(\d+)(\.|$)", path)
        if m:
            return _strip(m.group(1)), int(m.group(2))
    return None


_CALLED_AGAIN: "weakref.WeakKeyDictionary[torch.fx.Graph, tuple]" = weakref.WeakKeyDictionary()


def _called_again(graph: torch.fx.Graph) -> frozenset[str]:
    """The module-stack keys (without their ``@k``) of modules called more than once in
    ``graph``, each call running at least two ops and reading a parameter (an input named
    as torch.export names a parameter's placeholder: ``p_...``); kept per graph while its
    nodes stay."""
    names = len(graph.nodes)
    hit = _CALLED_AGAIN.get(graph)
    if hit is None or hit[0] != names:
        ops: dict[str, dict[int, int]] = {}
        learned: dict[str, set[int]] = {}     # the calls that read a parameter
        for n in graph.nodes:
            if n.op != "call_function":
                continue
            reads = any(a.op == "placeholder" and a.name.startswith("p_") for a in n.all_input_nodes)
            for key in (n.meta.get("nn_module_stack") or {}):
                base, _, call = key.partition("@")
                calls = ops.setdefault(base, {})
                k = int(call) if call.isdigit() else 0
                calls[k] = calls.get(k, 0) + 1
                if reads:
                    learned.setdefault(base, set()).add(k)
        found = frozenset(b for b, calls in ops.items()
                          if len(calls) >= 2 and min(calls.values()) >= 2
                          and learned.get(b, set()) >= set(calls))
        hit = _CALLED_AGAIN[graph] = (names, found)
    return hit[1]
