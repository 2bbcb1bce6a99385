"""A per-user cache of captured graphs: planning the same model again (another cluster, a
changed pin, an elastic re-plan) reads the graph from disk instead of exporting it.

What is stored is what :func:`autopar.capture.capture` returns (the ``Captured``: after
stamping, inlining and the sequence layout), the graph as a flat list of nodes (name, op,
target, arguments, meta) whose FakeTensor values are kept as their shape, stride, dtype,
device and ``requires_grad`` and made again as FakeTensors of one new ``FakeTensorMode`` on
load. The graph's name counters (``_graph_namespace``) are kept too: a pass that adds nodes
later names them as it would have on the exported graph, so a plan made on a cached graph
is the plan made on a fresh one (the same digest; ``tests/test_capture_cache.py``).

The key (:func:`capture_key`) is a SHA-256 of everything the export reads: each module's
path, class and the text of the file that defines it (its forward and the helpers beside
it), its simple attributes (ints, floats, strings, ...), a Hugging Face config's JSON, its
training flag, hooks; every parameter's and buffer's name, shape, dtype, device and
``requires_grad`` and which are tied; the example inputs' and target's shapes, strides and
dtypes; the loss function (its qualified name and its file's text); the torch version, the
default dtype, grad mode, the context layout (``sequence_layout``), and the source of
autopar's capture code (:data:`CAPTURE_SOURCES`), so a change to any of them is a miss. A
model whose forward reads state none of these show (a global variable, an attribute that is
an arbitrary object) should be planned with ``cache=False``.

Where (under ``captures/``): ``$AUTOPAR_CACHE_DIR``, else ``$AUTOPAR_CACHE`` when it names a
folder (as the profiler and the machine figures read it), else ``$XDG_CACHE_HOME/autopar``,
else ``~/.cache/autopar``. ``AUTOPAR_CACHE=0`` turns it off, as do ``autopar.plan(...,
cache=False)`` and ``autopar plan --no-cache``. An entry that cannot be read (corrupt,
another format, another key) is ignored and replaced; a cache that cannot be written is
skipped. Neither is ever an error of planning.

Only planning uses it (``driver.solve`` opens :func:`caching`); the per-rank programs of a
run given a plan capture afresh.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import inspect
import io
import json
import os
import pickle
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._guards import detect_fake_mode
from torch._ops import _higher_order_ops
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.fx.node import map_aggregate

FORMAT = 1
"""The entry format; an entry of another format is a miss (and is replaced)."""

CAPTURE_SOURCES = ("capture", "ops", "errors.py")
"""autopar's files, relative to the package, whose text is part of every key: the capture
code (export, stamping, inlining), the ops it puts in the graph, the errors it raises. A
change to any of them makes every entry stale."""


class _Unstorable(Exception):
    """The graph holds something the cache does not store (it is then not cached)."""


# ---- switches and places ---------------------------------------------------------------------
_OFF = ("0", "false", "off", "no")
_ON = ("", "1", "true", "on", "yes")


def cache_dir() -> Path:
    """``$AUTOPAR_CACHE_DIR``; else ``$AUTOPAR_CACHE`` when it names a folder (the profiler's
    and the machine figures' setting, ``cost_models/machine.py``), else
    ``$XDG_CACHE_HOME/autopar``, else ``~/.cache/autopar``."""
    if os.environ.get("AUTOPAR_CACHE_DIR"):
        return Path(os.environ["AUTOPAR_CACHE_DIR"])
    env = os.environ.get("AUTOPAR_CACHE", "")
    if env.strip().lower() not in _OFF + _ON:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autopar"


def enabled_by_env() -> bool:
    """False when ``AUTOPAR_CACHE`` is ``0`` (or ``false``, ``off``, ``no``)."""
    return os.environ.get("AUTOPAR_CACHE", "").strip().lower() not in _OFF


@dataclass
class CacheUse:
    """The captures of one planning: how many there were and how many the cache gave."""
    enabled: bool
    captures: int = 0
    hits: int = 0
    stored: int = 0

    def describe(self) -> str:
        """``"off"``, ``"hit"`` (every capture from the cache), ``"miss"`` (none), or
        ``"2 of 3 from the cache"``; ``""`` when nothing was captured."""
        if not self.enabled:
            return "off"
        if self.captures == 0:
            return ""
        if self.hits == self.captures:
            return "hit"
        return "miss" if self.hits == 0 else f"{self.hits} of {self.captures} from the cache"


_USE: contextvars.ContextVar[CacheUse | None] = contextvars.ContextVar("autopar_capture_cache",
                                                                      default=None)


@contextlib.contextmanager
def caching(enabled: bool = True):
    """While open, :func:`autopar.capture.capture` reads and writes the cache (when
    ``enabled`` and ``AUTOPAR_CACHE`` is not 0); yields the :class:`CacheUse` it counts in.
    Nested, the outer one counts (the CLI's capture and its ``solve`` are one planning)."""
    outer = _USE.get()
    if outer is not None:
        yield outer
        return
    use = CacheUse(enabled and enabled_by_env())
    token = _USE.set(use)
    try:
        yield use
    finally:
        _USE.reset(token)


def current_use() -> CacheUse | None:
    return _USE.get()


# ---- the key ---------------------------------------------------------------------------------
_FILE_HASH: dict[tuple, str] = {}
_FILE_LOCK = threading.Lock()


def _file_hash(path: str) -> str:
    """SHA-256 of a file's bytes, remembered while its size and mtime stay (a file edited
    in a long-running process, a notebook's, is read again)."""
    st = os.stat(path)
    memo = (path, st.st_size, st.st_mtime_ns)
    with _FILE_LOCK:
        got = _FILE_HASH.get(memo)
    if got is None:
        with open(path, "rb") as f:
            got = hashlib.sha256(f.read()).hexdigest()
        with _FILE_LOCK:
            _FILE_HASH[memo] = got
    return got


def _source_of(obj) -> str:
    """The hash of the file that defines ``obj`` (a class or a function)."""
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:              # a builtin: its module's name and version say it
        path = None
    if path is None or not os.path.isfile(path):
        module = getattr(obj, "__module__", None) or ""
        if module.startswith(("torch", "builtins", "_operator", "math")):
            return f"builtin:{module}"
        raise _Unstorable(f"no source file for {obj!r}")
    return _file_hash(path)


def _capture_source_hash() -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for rel in CAPTURE_SOURCES:
        p = root / rel
        files = sorted(p.rglob("*.py")) if p.is_dir() else [p]
        for f in files:
            h.update(f"{f.relative_to(root)}:{_file_hash(str(f))}\n".encode())
    return h.hexdigest()


_SIMPLE = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _simple(v) -> bool:
    if isinstance(v, (tuple, list)):
        return all(_simple(x) for x in v)
    return isinstance(v, _SIMPLE)


def _tensor_sig(t) -> str:
    if not isinstance(t, torch.Tensor):
        raise _Unstorable(f"an input of type {type(t).__name__}")
    if isinstance(t, FakeTensor):
        raise _Unstorable("fake inputs")
    return (f"{tuple(t.shape)}|{t.stride()}|{t.storage_offset()}|{t.dtype}|{t.device.type}|"
            f"{t.requires_grad}")


def _module_lines(model: nn.Module) -> list[str]:
    lines = []
    classes = {}
    configs: dict[int, str] = {}      # one JSON per config object (a model's layers share one)
    for path, m in model.named_modules(remove_duplicate=False):
        cls = type(m)
        classes[cls] = None
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks:
            raise _Unstorable(f"module {path or type(m).__name__} has hooks")
        attrs = sorted((k, repr(v) if _simple(v) else f"<{type(v).__module__}."
                        f"{type(v).__qualname__}>")
                       for k, v in vars(m).items()
                       if not k.startswith("_") and k != "config" and k != "training")
        cfg = getattr(m, "config", None)
        cfg_text = ""
        if cfg is not None and hasattr(cfg, "to_json_string"):
            if id(cfg) not in configs:
                # the JSON leaves out private settings that change the graph, such as
                # ``_attn_implementation`` (eager, sdpa, flex_attention): their values too
                private = sorted((k, repr(v)) for k, v in vars(cfg).items()
                                 if k.startswith("_") and _simple(v))
                configs[id(cfg)] = cfg.to_json_string(use_diff=False) + repr(private)
            cfg_text = configs[id(cfg)]
        elif cfg is not None:
            cfg_text = repr(cfg) if _simple(cfg) else f"<{type(cfg).__qualname__}>"
        lines.append(f"module {path}|{cls.__module__}.{cls.__qualname__}|{m.training}|"
                     f"{attrs}|{cfg_text}")
    for cls in classes:
        for base in cls.__mro__:
            if base in (nn.Module, object):
                break
            lines.append(f"class {base.__module__}.{base.__qualname__}|{_source_of(base)}")
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied = first.setdefault(id(p), name)
        lines.append(f"param {name}|{_tensor_sig(p)}|{tied}")
    for name, b in model.named_buffers(remove_duplicate=False):
        tied = first.setdefault(id(b), name)
        lines.append(f"buffer {name}|{_tensor_sig(b)}|{tied}")
    return lines


def _loss_line(loss_fn) -> str:
    if loss_fn is None:
        return "loss None"
    if isinstance(loss_fn, nn.Module):
        return "loss module\n" + "\n".join(_module_lines(loss_fn))
    fn = getattr(loss_fn, "func", loss_fn)          # functools.partial: its function
    extra = ""
    if fn is not loss_fn:
        parts = (list(getattr(loss_fn, "args", ()))
                 + sorted(getattr(loss_fn, "keywords", {}).items()))
        if not _simple([v for p in parts for v in (p if isinstance(p, tuple) else (p,))]):
            raise _Unstorable("a partial loss with arguments that are not simple")
        extra = repr(parts)
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    if getattr(fn, "__closure__", None):
        raise _Unstorable(f"loss_fn {name} is a closure")
    code = getattr(fn, "__code__", None)      # which function of its file (two lambdas)
    where = (f"{code.co_firstlineno}|{hashlib.sha256(code.co_code).hexdigest()}"
             if code is not None else "")
    return (f"loss {name}|{where}|{extra}|"
            f"{_source_of(fn if inspect.isroutine(fn) else type(fn))}")


def capture_key(model: nn.Module, example_inputs: tuple, loss_fn, target, stamp: bool,
                layout) -> str | None:
    """The cache key of one capture (a SHA-256, hex), or None where the capture is not
    cached (hooks, fake tensors, a loss or class without a source file, ...)."""
    try:
        lines = [f"format {FORMAT}", f"torch {torch.__version__}",
                 f"autopar {_capture_source_hash()}", f"stamp {stamp}",
                 f"layout {layout!r}", f"default dtype {torch.get_default_dtype()}",
                 f"grad {torch.is_grad_enabled()}", f"autocast {torch.is_autocast_enabled()}"]
        lines += _module_lines(model)
        lines += [f"input {_tensor_sig(t)}" for t in example_inputs]
        lines.append("target " + ("None" if target is None else _tensor_sig(target)))
        lines.append(_loss_line(loss_fn))
    except _Unstorable:
        return None
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


# ---- the graph on disk -----------------------------------------------------------------------
class _Pickler(pickle.Pickler):
    """Nodes as their names, FakeTensors as their metadata, ATen ops by their names."""

    def __init__(self, f, nodes: dict[torch.fx.Node, str]):
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.nodes = nodes

    def persistent_id(self, obj):
        if isinstance(obj, torch.fx.Node):
            if obj not in self.nodes:
                raise _Unstorable(f"a reference to node {obj.name} of another graph")
            return ("node", self.nodes[obj])
        if isinstance(obj, torch.Tensor):
            if not isinstance(obj, FakeTensor):
                raise _Unstorable("a real tensor in the graph")
            if any(not isinstance(s, int) for s in (*obj.shape, *obj.stride())):
                raise _Unstorable("symbolic shapes")
            return ("fake", tuple(obj.shape), tuple(obj.stride()), obj.storage_offset(),
                    obj.dtype, str(obj.device), obj.requires_grad)
        if isinstance(obj, torch._ops.OpOverload):
            return ("op", obj._schema.name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return ("packet", obj._qualified_op_name)
        if isinstance(obj, torch._ops.HigherOrderOperator):
            return ("hop", obj.name())
        if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise _Unstorable("symbolic values")
        return None


class _NodeRef:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


def _packet(qualified: str):
    ns, _, name = qualified.partition("::")
    return getattr(getattr(torch.ops, ns), name)


class _Unpickler(pickle.Unpickler):
    def __init__(self, f, mode: FakeTensorMode):
        super().__init__(f)
        self.mode = mode

    def persistent_load(self, pid):
        kind = pid[0]
        if kind == "node":
            return _NodeRef(pid[1])
        if kind == "fake":
            # a FakeTensor around a meta tensor, made directly (through the mode's dispatch
            # each costs ~100x more: 20 of 37 s loading Llama 3 8B's graph)
            _, shape, stride, offset, dtype, device, requires_grad = pid
            elem = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            if offset:
                elem = torch.empty(offset + _span(shape, stride), dtype=dtype,
                                   device="meta").as_strided(shape, stride, offset)
            if requires_grad:
                elem.requires_grad_(True)
            return FakeTensor(self.mode, elem, torch.device(device))
        if kind == "op":
            packet = _packet(pid[1])
            return getattr(packet, pid[2] or "default")
        if kind == "packet":
            return _packet(pid[1])
        if kind == "hop":
            return _higher_order_ops[pid[1]]
        raise pickle.UnpicklingError(f"unknown reference {kind!r}")


def _span(shape, stride) -> int:
    """Elements a strided view of ``shape`` reaches past its offset."""
    return 0 if 0 in shape else 1 + sum((n - 1) * st for n, st in zip(shape, stride))


_SKIP_ATTRS = ("gm", "_by_name", "native_dtypes")


def dumps(cap) -> bytes:
    """``cap`` (a Captured) as bytes; raises :class:`_Unstorable` for what is not stored."""
    g = cap.gm.graph
    names = {n: n.name for n in g.nodes}
    records = []
    for n in g.nodes:
        if n.op in ("get_attr", "call_module"):
            raise _Unstorable(f"node {n.name} reads a submodule or attribute ({n.op})")
        records.append((n.name, n.op, n.target, n.args, n.kwargs, n.meta, n.type))
    ns = g._graph_namespace
    obj_names = {names[o]: v for o, v in ns._obj_to_name.items() if o in names}
    fields = {k: v for k, v in vars(cap).items() if k not in _SKIP_ATTRS}
    state = {"records": records, "used": sorted(ns._used_names), "count": dict(ns._base_count),
             "obj_names": obj_names, "fields": fields, "cls": type(cap),
             "gm_meta": dict(getattr(cap.gm, "meta", {}))}
    f = io.BytesIO()
    try:
        with warnings.catch_warnings():   # torch 2.13's pytree warns on pickling a LeafSpec
            warnings.simplefilter("ignore", FutureWarning)
            _Pickler(f, names).dump(state)
    except _Unstorable:
        raise
    except Exception as e:  # noqa: BLE001 - any value pickle cannot store: not cached
        raise _Unstorable(f"{type(e).__name__}: {e}") from None
    return f.getvalue()


def loads(data: bytes):
    """The Captured that :func:`dumps` stored, its FakeTensors in one new FakeTensorMode."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with warnings.catch_warnings():     # torch 2.13's pytree warns on unpickling a LeafSpec
        warnings.simplefilter("ignore", FutureWarning)
        state = _Unpickler(io.BytesIO(data), mode).load()
    g = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}

    def resolve(x):
        return env[x.name] if isinstance(x, _NodeRef) else x

    for name, op, target, args, kwargs, meta, type_expr in state["records"]:
        args = map_aggregate(args, resolve)
        kwargs = map_aggregate(kwargs, resolve)
        if op == "output":
            node = g.output(args[0], type_expr=type_expr)
            node.name = name
        else:
            node = g.create_node(op, target, tuple(args), dict(kwargs), name=name,
                                 type_expr=type_expr)
        if node.name != name:
            raise ValueError(f"node {name} was named {node.name}")
        node.meta = meta
        env[name] = node
    ns = g._graph_namespace
    ns._used_names = set(state["used"])
    ns._base_count.clear()
    ns._base_count.update(state["count"])
    ns._obj_to_name.clear()
    for name, registered in state["obj_names"].items():
        ns._obj_to_name[env[name]] = registered
    with _use_lazy_graph_module(True):   # its Python code made when first asked for
        gm = _make_graph_module(nn.Module(), g)
    gm.meta.update(state["gm_meta"])
    cls = state["cls"]
    cap = cls.__new__(cls)
    cap.__dict__.update(state["fields"])
    cap.gm = gm
    cap.__post_init__()
    return cap


# ---- the store -------------------------------------------------------------------------------
def _entry(key: str) -> Path:
    return cache_dir() / "captures" / f"{key}.pt"


def load(key: str):
    """The Captured stored under ``key``, or None (no entry; or one that cannot be read,
    which is removed so that it is replaced)."""
    path = _entry(key)
    try:
        with open(path, "rb") as f:
            head = f.readline()
            data = f.read()
    except OSError:
        return None
    try:
        got = json.loads(head)
        if (got.get("format"), got.get("key"), got.get("torch")) != (FORMAT, key,
                                                                       torch.__version__):
            raise ValueError("another format or key")
        if hashlib.sha256(data).hexdigest() != got.get("sha256"):
            raise ValueError("its bytes do not match their hash")
        return loads(data)
    except Exception:  # noqa: BLE001 - corrupt or stale: ignored, and replaced below
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def store(key: str, cap) -> bool:
    """Write ``cap`` under ``key`` (atomically: a reader sees the old entry or the new one);
    False where it is not stored (what it holds, or a cache that cannot be written)."""
    try:
        data = dumps(cap)
    except _Unstorable:
        return False
    path = _entry(key)
    head = json.dumps({"format": FORMAT, "key": key, "torch": torch.__version__,
                       "sha256": hashlib.sha256(data).hexdigest()}).encode() + b"\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".pt")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(head)
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError:
        return False
    return True


def cached_capture(model, example_inputs: tuple, loss_fn, target, stamp: bool, layout,
                   capture_fn):
    """``capture_fn()`` through the cache of the open :func:`caching` (none open, or off:
    ``capture_fn()`` as it is)."""
    use = _USE.get()
    if use is None or not use.enabled or _fake_mode_active():
        return capture_fn()
    use.captures += 1
    key = capture_key(model, example_inputs, loss_fn, target, stamp, layout)
    if key is None:
        return capture_fn()
    got = load(key)
    if got is not None:
        use.hits += 1
        return got
    cap = capture_fn()
    if store(key, cap):
        use.stored += 1
    return cap


def _fake_mode_active() -> bool:
    try:
        return detect_fake_mode() is not None
    except Exception:  # noqa: BLE001 - cannot tell: do not cache
        return True
