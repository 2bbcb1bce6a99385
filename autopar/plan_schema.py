"""The plan file's schema (JSON Schema, draft 2020-12) and the check ``Plan.load`` runs.

Errors name the field, the value found and what was expected, e.g.
``plan field nodes.linear.outputs[0]: 'Q(3)' is not a placement (expected R, P, S(d) or
S(d/g) per mesh axis, like "S(0)R")``. Placement strings are checked against the mesh: one
placement per axis.
"""
from __future__ import annotations

import re
from typing import Any

from autopar.errors import AutoparInputError


class PlanError(AutoparInputError):
    """A plan file or plan object is malformed or does not fit the model / world."""


PLACEMENTS = r"^((R|P|S\(-?\d+(/\d+)?\)))+$"

_NUM = {"type": "number"}
_INT = {"type": "integer"}
_STR = {"type": "string"}
_STRS = {"type": "array", "items": _STR}

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "autopar plan",
    "type": "object",
    "required": ["version", "world_size", "mesh_shape", "mesh_axes", "cluster", "options", "nodes",
                 "params", "fingerprint", "estimate", "solver"],
    "properties": {
        "version": {"const": 3},
        "world_size": {"type": "integer", "minimum": 1},
        "mesh_shape": {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1},
        "mesh_axes": _STRS,
        "cluster": _STR,
        "options": {"type": "object"},
        "nodes": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["inputs", "outputs"],
            "properties": {"inputs": {"type": "array", "items": {"type": "string", "pattern": PLACEMENTS}},
                           "outputs": {"type": "array", "items": {"type": "string", "pattern": PLACEMENTS}}}}},
        "params": {"type": "object", "additionalProperties": _STR},
        "fingerprint": _STR,
        "estimate": {"type": "object",
                     "required": ["step_time_s", "compute_s", "comm_s", "memory_bytes", "comm"],
                     "properties": {"step_time_s": _NUM, "compute_s": _NUM, "comm_s": _NUM,
                                    "memory_bytes": {"type": "object", "additionalProperties": _NUM},
                                    "comm": {"type": "object", "additionalProperties": _NUM},
                                    "bubble_fraction": _NUM, "host_s": _NUM,
                                    "stage_times_s": {"type": "array", "items": _NUM},
                                    "rank_memory_bytes": {"type": "array", "items": {
                                        "type": "object", "additionalProperties": _NUM}},
                                    "memory_phases": {"type": "array",
                                                      "items": {"type": "array", "items": _STR}}}},
        "solver": {"type": "object",
                   "required": ["status", "objective_s", "bound_s", "gap", "solve_time_s"],
                   "properties": {"status": _STR, "objective_s": _NUM, "bound_s": _NUM,
                                  "gap": _NUM, "solve_time_s": _NUM, "time_limit": _STR,
                                  "capture_cache": _STR, "skipped": _STR,
                                  "phases": {"type": "object", "additionalProperties": _NUM}}},
        "memory_budget": {"type": ["number", "null"]},
        "param_shapes": {"type": "object", "additionalProperties": {"type": "array", "items": _INT}},
        "node_ops": {"type": "object", "additionalProperties": _STR},
        "inputs": _STRS,
        "recompute": _STRS,
        "accumulate": {"type": "integer", "minimum": 1},
        "offload": {"type": ["string", "null"]},
        "host_memory_bytes": {"type": "object", "additionalProperties": _NUM},
        "disk_bytes": {"type": "object", "additionalProperties": _NUM},
        "alternatives_s": {"type": "object", "additionalProperties": _NUM},
        "branches": {"type": "array", "items": {
            "type": "object", "required": ["fork", "join", "groups"],
            "properties": {"fork": _STR, "join": _STR,
                           "groups": {"type": "array", "minItems": 2, "items": _STRS}}}},
        "pipeline": {"type": ["object", "null"],
                     "required": ["stages", "virtual_stages", "n_microbatches", "schedule", "stage_cuts"],
                     "properties": {"stages": {"type": "integer", "minimum": 1},
                                    "virtual_stages": {"type": "integer", "minimum": 1},
                                    "n_microbatches": {"type": "integer", "minimum": 1},
                                    "schedule": _STR, "stage_cuts": _STRS}},
    },
}

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is(value, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[t])


def _fail(path: str, value, expected: str):
    shown = repr(value)
    shown = shown if len(shown) < 80 else shown[:77] + "..."
    raise PlanError(f"plan field {path or '(top)'}: {shown} {expected}")


def check(value, schema: dict = SCHEMA, path: str = "", mesh_axes: int | None = None) -> None:
    """Raise PlanError at the first place ``value`` breaks ``schema``."""
    if "const" in schema and value != schema["const"]:
        _fail(path, value, f"is not supported (expected {schema['const']!r})")
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_is(value, t) for t in types):
            _fail(path, value, f"has the wrong type (expected {' or '.join(types)})")
    if isinstance(value, dict):
        if path == "" and mesh_axes is None and isinstance(value.get("mesh_shape"), list):
            mesh_axes = len(value["mesh_shape"])
        for key in schema.get("required", ()):
            if key not in value:
                _fail(f"{path}.{key}".lstrip("."), "<missing>", "is required")
        props = schema.get("properties", {})
        for key, sub in value.items():
            child = props.get(key, schema.get("additionalProperties"))
            if isinstance(child, dict):
                check(sub, child, f"{path}.{key}".lstrip("."), mesh_axes)
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            _fail(path, value, f"needs at least {schema['minItems']} entries")
        for i, item in enumerate(value):
            if "items" in schema:
                check(item, schema["items"], f"{path}[{i}]", mesh_axes)
    if isinstance(value, (int, float)) and "minimum" in schema and value < schema["minimum"]:
        _fail(path, value, f"is below the minimum {schema['minimum']}")
    if isinstance(value, str) and "pattern" in schema:
        if not re.match(schema["pattern"], value):
            _fail(path, value, 'is not a placement (expected R, P, S(d) or S(d/g) per mesh axis, like "S(0)R")')
        if mesh_axes is not None and schema["pattern"] == PLACEMENTS:
            n = len(re.findall(r"R|P|S\(", value))
            if n != mesh_axes:
                _fail(path, value, f"has {n} placements but the mesh has {mesh_axes} axes")
