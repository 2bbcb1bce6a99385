"""Per-op sharding rules (registry in ``registry.py``, rules by op family in ``rules/``)."""
from autopar.sharding.registry import (  # noqa: F401
    OpCall, Strategy, TensorMeta, axis_strategies, has_rule, localize, make_call,
    mesh_strategies, register_local, register_rule,
)

__all__ = ["OpCall", "Strategy", "TensorMeta", "axis_strategies", "has_rule", "localize",
           "make_call", "mesh_strategies", "register_local", "register_rule"]
