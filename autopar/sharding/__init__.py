"""Per-op sharding rules (registry in ``registry.py``, rules by op family in ``rules/``)."""
from autopar.sharding.registry import (  # noqa: F401
    OpCall, Strategy, TensorMeta, axis_strategies, has_rule, localize, make_call,
    mesh_strategies, register_local, register_rule,
)
# Fills the registry: every rule module registers its ops when imported. After the registry
# (the rule modules import it), so there is no circle.
from autopar.sharding import rules  # noqa: F401,E402

__all__ = ["OpCall", "Strategy", "TensorMeta", "axis_strategies", "has_rule", "localize",
           "make_call", "mesh_strategies", "register_local", "register_rule"]
