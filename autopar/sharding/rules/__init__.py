"""Sharding rules by op family; importing this package fills the registry."""
import importlib

for _family in ("pointwise", "matmul", "reductions", "norms", "attention", "conv",
                "views", "embedding", "losses", "misc"):
    try:
        importlib.import_module(f"autopar.sharding.rules.{_family}")
    except ModuleNotFoundError as e:  # a family not written yet
        if e.name != f"autopar.sharding.rules.{_family}":
            raise
