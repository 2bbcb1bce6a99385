"""Capture a deep model fast: export a shallow copy of it and stamp the remaining layers.

torch.export costs a few milliseconds per graph node, so a 96-layer model spends most of its
capture tracing 95 copies of one layer. :func:`export_stamped` exports the model with its
container of repeated blocks cut to its first :data:`SHALLOW` blocks (the container is
swapped for a shorter one and restored in ``finally``), checks on that graph that the last
blocks repeat exactly (each block's nodes are the previous block's with the block index
moved on: op, target, arguments, shapes, strides, module stacks, name counters), and
builds the full-depth graph by stamping the template block ``SHALLOW - 1`` once per
missing block. The result is the graph torch.export returns for the whole model: the same
node names in the same order (export names nodes by counters per base name in creation
order, and parameter placeholders after their FQNs), the same targets and arguments, the
same ``meta["val"]`` shapes, dtypes and strides, the same ``nn_module_stack`` paths, the
same placeholders and signature, the same graph namespace (so nodes added later are named
the same) and hence the same :func:`autopar.capture.fingerprint`.

It applies to a model whose largest container (by parameters) is an ``nn.ModuleList`` of
at least :data:`MIN_BLOCKS` distinct blocks of one structure (classes, parameter and buffer
shapes, other attributes equal, no hooks), looped over plainly: read from the source of
the forwards above it, one ``for block in self.<path>:`` (or ``self.<path>[:n]``) whose
body only assigns calls of ``block``, and while tracing the shortened container is only
iterated (``len()``, an index or a partial slice would be answered wrongly: refused). An
int attribute equal to the block's own index (Hugging Face's ``layer_idx``) is allowed
only where the blocks' forwards merely pass it to a call (Hugging Face hands it to its KV
cache, unused with ``use_cache=False``); that a callee does not branch on it for a block
past the shallow copy is the one thing these checks assume rather than see. Anything else,
or any check that fails, returns None and :func:`autopar.capture.capture` exports the whole
model as before: a model without such a container says why at debug level; one whose
container qualified but did not stamp says why at warning level (that capture is slower).

The values of stamped nodes (``meta["val"]``) are the template block's fake tensors,
shared: equal shapes, dtypes, strides and storage offsets; storage sharing across layers is
not what export gives (no planning step reads it).
"""
from __future__ import annotations

import ast
import inspect
import logging
import re
import textwrap
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.export.graph_signature import (ExportGraphSignature, InputKind, InputSpec,
                                          OutputSpec, TensorArgument)
from torch.fx.node import map_aggregate

log = logging.getLogger(__name__)

TORCH_FX_PRIVATE = {
    "Graph._graph_namespace": "the graph's node-name counters, read to check the shallow "
                              "export's and copied to the full graph (so later nodes are "
                              "named as export names them)",
    "_Namespace._used_names": "every name given out",
    "_Namespace._base_count": "the next counter of each base name ('linear' -> linear_7)",
    "_Namespace._obj_to_name": "the name each node got (placeholders: arg0_1, ...)",
    "Graph._tracer_cls, Graph._tracer_extras": "what torch.fx.Graph() is made with, so the "
                                              "stamped graph is built as export builds its own",
}
"""The private torch.fx state stamping reads and writes, in one place. Checked on the
torch versions of CHECKED_TORCH (``tests/test_capture_stamp.py`` compares every stamped
capture with the whole export, node by node; run on each of them: docs/versions.md);
a torch that changes it makes stamping fail, which ``export_stamped`` reports
at warning level before exporting the model whole."""
CHECKED_TORCH = ("2.11", "2.13", "2.15")

MIN_BLOCKS = 8       # a container of fewer blocks is exported whole
SHALLOW = 4          # blocks exported: 0 (reads the prologue), then 1..3 (two checked steps)
_NAME = re.compile(r"^([a-zA-Z_][0-9a-zA-Z_]*?)(?:_(\d+))?$")   # torch.fx's name counters
_FN = re.compile(r"^(.*)_(\d+)$")                                 # meta["torch_fn"] ids
_KNOWN_META = {"val", "tensor_meta", "nn_module_stack", "torch_fn", "stack_trace", "custom",
               "eager_input_vals"}   # a custom op's inputs, as export saw them (the experts op)
_VALUE_META = ("val", "eager_input_vals")     # fake tensors: compared by shape, dtype, strides


class _Refuse(Exception):
    """Stamping does not apply: fall back to the whole export."""


@dataclass
class StampedProgram:
    """What :func:`autopar.capture.export._from_program` reads of an ExportedProgram."""
    graph_module: torch.fx.GraphModule
    graph_signature: ExportGraphSignature
    constants: dict
    call_spec: Any
    blocks: int                       # how many blocks were stamped (for the log / tests)


def export_stamped(root: nn.Module, args: tuple, export: Callable) -> StampedProgram | None:
    """``export(root, args)`` at full depth, from a shallow export plus stamping; None when
    stamping does not apply (then export the model whole)."""
    try:
        return _export_stamped(root, args, export)
    except Exception as e:  # noqa: BLE001 - never worse than the whole export, which runs next
        log.warning("capture: exporting %s whole (slower: every block traced): stamping its "
                    "repeated blocks failed (%s: %s) on torch %s (stamping was checked on "
                    "torch %s)", _model_name(root), type(e).__name__, e,
                    torch.__version__, ", ".join(CHECKED_TORCH))
        return None


def _model_name(root: nn.Module) -> str:
    """The user's model's class (capture wraps it with its loss as ``root.model``)."""
    inner = getattr(root, "model", None)
    return type(inner if isinstance(inner, nn.Module) else root).__name__


def _export_stamped(root: nn.Module, args: tuple, export: Callable) -> StampedProgram | None:
    found = find_container(root)
    if found is None:
        return None
    path, container = found
    parent_path, _, attr = path.rpartition(".")
    parent = root.get_submodule(parent_path)
    shallow = _ShallowList.of(list(container)[:SHALLOW], len(container))
    setattr(parent, attr, shallow)
    try:
        params = [n for n, _ in root.named_parameters(remove_duplicate=False)]
        buffers = [n for n, _ in root.named_buffers(remove_duplicate=False)]
        ep = export(root, args)
        touched = list(shallow.touched)
    except Exception as e:  # noqa: BLE001 - the whole export runs next and reports its own
        log.warning("capture: exporting %s whole (slower: every block traced): its export "
                    "with %d of the %d blocks of %s failed (%s: %s)", _model_name(root),
                    SHALLOW, len(container), path, type(e).__name__, e)
        return None
    finally:
        setattr(parent, attr, container)
    try:
        if touched:
            raise _Refuse(f"the forward reads {path} by {touched[0]}, not only by iterating it")
        prog = _Stamper(ep, path, len(container), params, buffers).run(root)
    except _Refuse as e:       # the blocks looked alike but do not repeat exactly
        log.warning("capture: exporting %s whole (slower: every block traced): %s",
                    _model_name(root), e)
        return None
    log.debug("capture: %s exported with %d of %d blocks of %s, %d stamped",
              type(root).__name__, SHALLOW, len(container), path, prog.blocks)
    return prog


class _ShallowList(nn.ModuleList):
    """The first blocks of a container; notes every use but iteration (and ``[:n]`` with
    ``n`` at least the full length, Hugging Face's ``layers[:num_hidden_layers]``) in its
    class's ``touched`` (export restores the instance's attributes after tracing)."""
    touched: list[str]
    n_full: int

    @classmethod
    def of(cls, blocks, n_full: int) -> "_ShallowList":
        sub = type(cls.__name__, (cls,), {"touched": [], "n_full": n_full})
        out = sub(blocks)
        out.touched.clear()                           # ModuleList.__init__ calls len()
        return out

    def __len__(self):
        self.touched.append("len()")
        return super().__len__()

    def __getitem__(self, idx):
        if (isinstance(idx, slice) and idx.start in (None, 0) and idx.step in (None, 1)
                and (idx.stop is None or (isinstance(idx.stop, int) and idx.stop >= self.n_full))):
            return self
        self.touched.append(f"[{idx!r}]")
        return super().__getitem__(idx)


# ---- which container, and are its blocks alike ---------------------------------------------


def find_container(root: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """(path, container) of the ModuleList holding most parameters, when its blocks are
    alike (:func:`blocks_alike`) and at least MIN_BLOCKS; else None."""
    best, best_size = None, 0
    for path, m in root.named_modules():
        if type(m) is nn.ModuleList and len(m) >= MIN_BLOCKS and path:
            size = sum(p.numel() for p in m.parameters())
            if size > best_size:
                best, best_size = (path, m), size
    if best is None:
        return None
    why = blocks_alike(root, list(best[1])) or plain_loop(root, best[0])
    if why:
        log.debug("capture: whole export of %s: blocks of %s differ: %s",
                  type(root).__name__, best[0], why)
        return None
    return best


def blocks_alike(root: nn.Module, blocks: list[nn.Module]) -> str:
    """'' when ``blocks`` are distinct modules of one structure (classes, parameter and
    buffer shapes, dtypes, other attributes equal up to an int equal to the block's index),
    else what differs."""
    if len({id(b) for b in blocks}) != len(blocks):
        return "one module appears twice"
    counts: dict[int, int] = {}
    for _, p in root.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    ref = _skeleton(blocks[0])
    index_attrs = set()
    for i, b in enumerate(blocks):
        sk = _skeleton(b)
        if sk is None or ref is None:
            return f"block {i} has hooks or tensor attributes"
        if len(sk) != len(ref) or not all(x == y or _is_index(x, y, i) for x, y in zip(sk, ref)):
            return f"block {i} is not block 0 up to its index"
        index_attrs |= {x[2] for x, y in zip(sk, ref) if x != y}
    if index_attrs:
        return _index_reads(blocks[0], index_attrs)
        if any(counts.get(id(p), 0) != 1 for p in b.parameters(recurse=True)):
            return f"a parameter of block {i} is shared"
    return ""


def plain_loop(root: nn.Module, path: str) -> str:
    """'' when exactly one forward above the container (read from its source) loops over
    it plainly: ``for block in self.<path>:`` (or ``self.<path>[:n]``) whose body only
    assigns calls of ``block``, so no block is told its position; else why not."""
    parts = path.split(".")
    loops, uses = [], 0
    for i in range(len(parts)):
        owner = root.get_submodule(".".join(parts[:i]))
        forward = type(owner).forward
        if forward in (nn.ModuleList.forward, nn.ModuleDict.forward, nn.Module.forward):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
        except (OSError, TypeError, SyntaxError):
            return f"the source of {type(owner).__name__}.forward cannot be read"
        chain = ["self", *parts[i:]]
        for node in ast.walk(tree):
            if _chain(node) == chain:
                uses += 1
            if isinstance(node, ast.For) and _loop_over(node.iter, chain):
                loops.append(node)
    if len(loops) != 1 or uses != 1:
        return f"{len(loops)} loops and {uses} uses of {path} in the forwards above it"
    loop = loops[0]
    if not isinstance(loop.target, ast.Name) or loop.orelse:
        return "the loop's target is not one name"
    for stmt in loop.body:
        if not (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == loop.target.id
                and all(isinstance(t, (ast.Name, ast.Tuple)) for t in stmt.targets)):
            return f"the loop's body does more than call {loop.target.id} (line {stmt.lineno})"
    return ""


def _chain(node) -> list[str] | None:
    """``self.a.b`` as ["self", "a", "b"]."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(names)]
    return None


def _loop_over(it, chain) -> bool:
    if isinstance(it, ast.Subscript) and isinstance(it.slice, ast.Slice):
        if it.slice.lower is not None or it.slice.step is not None:
            return False
        it = it.value
    return _chain(it) == chain


def _index_reads(block: nn.Module, names: set[str]) -> str:
    """'' when the index attributes ``names`` are read in the blocks' forwards only as
    arguments of a call (Hugging Face passes ``self.layer_idx`` to its cache); else where."""
    for cls in {type(m) for m in block.modules()}:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
        except (OSError, TypeError, SyntaxError):
            return f"the source of {cls.__name__}.forward cannot be read"
        passed = {id(a) for node in ast.walk(tree) if isinstance(node, ast.Call)
                  for a in [*node.args, *(k.value for k in node.keywords)]}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in names
                    and id(node) not in passed):
                return f"{cls.__name__}.forward reads {node.attr} (line {node.lineno})"
    return ""


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")


def _is_index(x, y, i: int) -> bool:
    """Attribute entry ``x`` of block ``i`` is ``y`` of block 0 but for holding the index."""
    return (x[:3] == y[:3] and x[0] == "attr" and x[3] == (int, i) and y[3] == (int, 0))


def _skeleton(block: nn.Module) -> list | None:
    """What two alike blocks share; None for what stamping does not handle."""
    out = []
    for name, m in block.named_modules():
        if any(getattr(m, h, None) for h in _HOOKS):
            return None                                # hooks: refuse
        for k, v in sorted(vars(m).items()):
            if k.startswith("_"):
                continue
            if isinstance(v, torch.Tensor):
                return None                            # a lifted constant: refuse
            out.append(("attr", name, k, _plain(v)))
        out.append((name, type(m)))
    for name, p in block.named_parameters(remove_duplicate=False):
        out.append(("p", name, tuple(p.shape), p.dtype, p.requires_grad, type(p)))
    for name, b in block.named_buffers(remove_duplicate=False):
        out.append(("b", name, tuple(b.shape), b.dtype))
    return out


def _plain(v):
    """A comparable stand-in for an attribute value: itself when it compares by value,
    else its identity (two blocks' distinct objects then differ)."""
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
        return (type(v), v)
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(_plain(x) for x in v))
    return ("id", id(v))


# ---- the shallow graph, checked and stamped ------------------------------------------------


def _split(name: str, regex=_NAME) -> tuple[str, int]:
    m = regex.match(name)
    if m is None:
        raise _Refuse(f"unexpected name {name!r}")
    return m.group(1), int(m.group(2) or 0)


def _join(base: str, num: int) -> str:
    return f"{base}_{num}" if num else base


class _Stamper:
    def __init__(self, ep, path: str, n_full: int, params: list[str], buffers: list[str]):
        self.ep, self.n, self.k = ep, n_full, SHALLOW
        self.gm, self.sig = ep.graph_module, ep.graph_signature
        self.g = self.gm.graph
        self.prefix = path + "."                     # "model.transformer.h."
        self.ph_prefix = re.sub(r"[^a-zA-Z0-9]", "_", self.prefix).lower()
        self.shallow_params, self.shallow_buffers = params, buffers

    # -- where things are
    def block_of_path(self, p: str) -> tuple[int, str] | None:
        if not p.startswith(self.prefix):
            return None
        idx, _, rest = p[len(self.prefix):].partition(".")
        return (int(idx), rest) if idx.isdigit() else None

    def block_of(self, node) -> int | None:
        found = {got[0] for path, _ in (node.meta.get("nn_module_stack") or {}).values()
                 if (got := self.block_of_path(path)) is not None}
        if len(found) > 1:
            raise _Refuse(f"node {node.name} is in two blocks")
        return found.pop() if found else None

    def run(self, root: nn.Module) -> StampedProgram:
        self.layout()
        self.check_steps()
        self.check_counters()
        return self.build(root)

    def layout(self):
        """Split the shallow graph: placeholders, prologue, blocks 0..k-1, epilogue."""
        k = self.k
        specs = self.sig.input_specs
        self.ph = [n for n in self.g.nodes if n.op == "placeholder"]
        if [s.arg.name for s in specs] != [n.name for n in self.ph]:
            raise _Refuse("placeholders are not in the signature's order")
        kinds = [s.kind for s in specs]
        order = [InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR,
                 InputKind.USER_INPUT]
        if any(kd not in order for kd in kinds) or kinds != sorted(kinds, key=order.index):
            raise _Refuse(f"input kinds {sorted(set(map(str, kinds)))} not in the usual order")
        if [s.target for s in specs if s.kind == InputKind.PARAMETER] != self.shallow_params:
            raise _Refuse("parameters are not exported in named_parameters order")
        if [s.target for s in specs if s.kind == InputKind.BUFFER] != self.shallow_buffers:
            raise _Refuse("buffers are not exported in named_buffers order")
        # block placeholders: (block, rest) and the export name rule "p_" + fqn, lowered
        self.ph_block: dict[torch.fx.Node, tuple[int, str]] = {}
        self.ph_by_block: dict[tuple[int, str], torch.fx.Node] = {}
        self.spec_of = {s.arg.name: s for s in specs}
        for node, s in zip(self.ph, specs):
            got = self.block_of_path(s.target) if s.target else None
            if got is None:
                continue
            if s.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
                raise _Refuse(f"block input {s.target} is a {s.kind}")
            head = ("p_" if s.kind == InputKind.PARAMETER else "b_") + self.ph_prefix + f"{got[0]}_"
            if not node.name.startswith(head):
                raise _Refuse(f"placeholder {node.name} is not named after {s.target}")
            self.ph_block[node] = got
            self.ph_by_block[got] = node
        rests = [sorted(r for (b, r) in self.ph_by_block if b == i) for i in range(k)]
        if any(r != rests[0] for r in rests):
            raise _Refuse("blocks have different parameters in the shallow graph")
        # call nodes: prologue, blocks 0..k-1 in order, epilogue
        body = [n for n in self.g.nodes if n.op not in ("placeholder", "output")]
        self.blocks: list[list[torch.fx.Node]] = [[] for _ in range(k)]
        self.pro, self.epi = [], []
        stage = -1
        for n in body:
            if n.op != "call_function":
                if n.op == "get_attr" and stage == -1:
                    self.pro.append(n)
                    continue
                raise _Refuse(f"node {n.name} is a {n.op} after the prologue")
            b = self.block_of(n)
            if b is None:
                if stage == -1:
                    self.pro.append(n)
                else:
                    stage = k
                    self.epi.append(n)
            elif b < stage or b >= k or (stage == k):
                raise _Refuse(f"node {n.name} of block {b} comes after block {stage}'s nodes")
            else:
                stage = b
                self.blocks[b].append(n)
        if stage != k and stage != k - 1:
            raise _Refuse("not every block shows in the graph")
        lens = {len(b) for b in self.blocks[1:]}
        if len(lens) != 1 or not self.blocks[1]:
            raise _Refuse(f"blocks 1..{k - 1} have {sorted(lens)} nodes")
        self.pos = {n: (b, p) for b, nodes in enumerate(self.blocks) for p, n in enumerate(nodes)}
        self.out = next(n for n in self.g.nodes if n.op == "output")

    # -- one step: block b's node -> block b+s's
    def counterpart(self, x, s: int, lookup) -> Any:
        """Node ``x`` read by a block b node, as block b+s reads it (``lookup(block, pos or
        rest)`` gives the node of another block)."""
        if x in self.pos:
            b, p = self.pos[x]
            return lookup(b + s, p)
        if x in self.ph_block:
            b, rest = self.ph_block[x]
            return lookup(b + s, rest)
        return x

    def rename_path(self, text: str, b: int, s: int) -> str:
        head = self.prefix + str(b)
        if text == head or text.startswith(head + "."):
            return self.prefix + str(b + s) + text[len(head):]
        if text.startswith("L__self__" + head):        # the stack's keys
            return "L__self__" + self.rename_path(text[len("L__self__"):], b, s)
        return text

    def moved_meta(self, node, b: int, s: int) -> dict:
        meta = {}
        for key, v in node.meta.items():
            if key == "nn_module_stack":
                v = {self.rename_path(kk, b, s): (self.rename_path(pp, b, s), ty)
                     for kk, (pp, ty) in v.items()}
            elif key == "torch_fn":
                base, num = _split(v[0], _FN)
                v = (f"{base}_{num + s * self.fn_delta.get(base, 0)}", v[1])
            elif key == "custom":
                v = dict(v)
            meta[key] = v
        return meta

    def moved_name(self, name: str, s: int) -> str:
        base, num = _split(name)
        return _join(base, num + s * self.delta.get(base, 0))

    def check_steps(self):
        """Blocks 1..k-1: each is the previous one moved by one (names, ops, arguments,
        shapes, module stacks); learns the name counters' step per block."""
        self.delta, self.fn_delta = {}, {}
        first, second = self.blocks[1], self.blocks[2]
        for a, c in zip(first, second):
            for table, x, y, rx in ((self.delta, a.name, c.name, _NAME),):
                (ba, na), (bc, nc) = _split(x, rx), _split(y, rx)
                if ba != bc or table.setdefault(ba, nc - na) != nc - na:
                    raise _Refuse(f"names {x} -> {y} do not step by a counter")
            fa, fc = a.meta.get("torch_fn"), c.meta.get("torch_fn")
            if fa is not None and fc is not None:
                (ba, na), (bc, nc) = _split(fa[0], _FN), _split(fc[0], _FN)
                if ba != bc or self.fn_delta.setdefault(ba, nc - na) != nc - na:
                    raise _Refuse(f"torch_fn {fa[0]} -> {fc[0]} does not step by a counter")
        if any(d <= 0 for d in self.delta.values()):
            raise _Refuse("a name counter does not grow from block to block")
        lookup = lambda b, key: (self.blocks[b][key] if isinstance(key, int)  # noqa: E731
                                 else self.ph_by_block[(b, key)])
        for b in range(1, self.k - 1):
            for a, c in zip(self.blocks[b], self.blocks[b + 1]):
                self.check_one(a, c, b, lookup)

    def check_one(self, a, c, b: int, lookup):
        where = f"{a.name} -> {c.name}"
        if (a.op, a.target) != (c.op, c.target) or self.moved_name(a.name, 1) != c.name:
            raise _Refuse(f"{where}: another op or name")
        try:
            args = map_aggregate((a.args, a.kwargs), lambda x: self.counterpart(x, 1, lookup)
                                 if isinstance(x, torch.fx.Node) else x)
        except (KeyError, IndexError) as e:
            raise _Refuse(f"{where}: reads a node of no matching block ({e})") from None
        if not _same(args, (c.args, c.kwargs)):
            raise _Refuse(f"{where}: other arguments")
        if set(a.meta) != set(c.meta) or not set(a.meta) <= _KNOWN_META:
            raise _Refuse(f"{where}: meta keys {sorted(set(a.meta) ^ set(c.meta) or a.meta)}")
        moved = self.moved_meta(a, b, 1)
        for key in a.meta:
            if key in _VALUE_META:
                if _val_sig(a.meta[key]) != _val_sig(c.meta[key]):
                    raise _Refuse(f"{where}: other {key}")
            elif moved[key] != c.meta[key]:
                raise _Refuse(f"{where}: other {key}")

    def check_counters(self):
        """From block 1 on, every name base of the blocks counts on by one per node in graph
        order (none was renamed or dropped after naming), and the graph's namespace knows no
        other name of those bases: then the epilogue's names, and the namespace's counters,
        move by the blocks' step."""
        ns = self.g._graph_namespace
        start = self.blocks[1][0]
        nodes = list(self.g.nodes)
        late = nodes[nodes.index(start):]
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        for n in late:
            if n.op == "placeholder":
                raise _Refuse(f"placeholder {n.name} after the blocks")
            base, num = _split(n.name)
            if base in self.delta:
                if base in last and num != last[base] + 1:
                    raise _Refuse(f"node {n.name} breaks the name counter of {base!r}")
                first.setdefault(base, num)
                last[base] = num
        for name in ns._used_names - {n.name for n in nodes}:
            base, num = _split(name)
            if base in first and num >= first[base]:
                raise _Refuse(f"the namespace holds {name}, the name of no node, in the blocks")
        n_ph = len(self.ph)
        if any(f"arg{i}_1" not in ns._used_names or ns._base_count.get(f"arg{i}") != 1
               for i in range(n_ph)) or f"arg{n_ph}_1" in ns._used_names:
            raise _Refuse("placeholders were not traced as arg<i>_1")
        for base, num in last.items():
            if ns._base_count.get(base) != num:
                raise _Refuse(f"the namespace counts {base!r} to {ns._base_count.get(base)}, "
                              f"not {num}")
        for n in late:
            if ns._obj_to_name.get(n, n.name) != n.name:
                raise _Refuse(f"node {n.name} was named {ns._obj_to_name[n]} while tracing")

    # -- the full graph
    def build(self, root: nn.Module) -> StampedProgram:
        k, n_full, t = self.k, self.n, self.k - 1
        extra = n_full - k
        g = torch.fx.Graph(tracer_cls=self.g._tracer_cls, tracer_extras=self.g._tracer_extras)
        new: dict[torch.fx.Node, torch.fx.Node] = {}
        ph_new: dict[tuple[int, str], torch.fx.Node] = {}
        blocks_new: list[list[torch.fx.Node]] = [[] for _ in range(n_full)]
        specs: list[InputSpec] = []

        def place(node, name, spec, b=None, rest=None):
            out = g.create_node("placeholder", name, name=name)
            out.meta = dict(node.meta)
            if b is not None:
                ph_new[(b, rest)] = out
            specs.append(InputSpec(spec.kind, TensorArgument(name), spec.target, spec.persistent))
            return out

        # placeholders: the template's inputs once more for each stamped block
        for kind in (InputKind.PARAMETER, InputKind.BUFFER):
            fqns = ([n for n, _ in root.named_parameters(remove_duplicate=False)]
                    if kind == InputKind.PARAMETER else
                    [n for n, _ in root.named_buffers(remove_duplicate=False)])
            by_target = {s.target: (node, s) for node, s in zip(self.ph, self.sig.input_specs)
                         if s.kind == kind}
            for fqn in fqns:
                got = self.block_of_path(fqn)
                if got is not None and got[0] >= k:
                    tmpl = self.ph_by_block.get((t, got[1]))
                    if tmpl is None:
                        raise _Refuse(f"no template input for {fqn}")
                    spec = self.spec_of[tmpl.name]
                    head = ("p_" if kind == InputKind.PARAMETER else "b_") + self.ph_prefix
                    name = head + f"{got[0]}_" + tmpl.name[len(head) + len(str(t)) + 1:]
                    spec = InputSpec(spec.kind, spec.arg, fqn, spec.persistent)
                    place(tmpl, name, spec, *got)
                    continue
                if fqn not in by_target:
                    raise _Refuse(f"input {fqn} of the full model is not in the shallow graph")
                node, spec = by_target.pop(fqn)
                new[node] = place(node, node.name, spec, *(got or (None, None)))
            if by_target:
                raise _Refuse(f"shallow inputs {sorted(by_target)[:2]} not in the full model")
        for node, s in zip(self.ph, self.sig.input_specs):
            if s.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
                new[node] = place(node, node.name, s)

        def lookup(b, key):
            return blocks_new[b][key] if isinstance(key, int) else ph_new[(b, key)]

        def copy(node, name=None):
            out = g.node_copy(node, lambda x: new[x])
            if name is not None and out.name != name:
                raise _Refuse(f"node {node.name} would be named {out.name}")
            return out

        for node in self.pro:
            new[node] = copy(node)
        for b in range(k):
            for node in self.blocks[b]:
                new[node] = copy(node)
                blocks_new[b].append(new[node])
        tmpl = self.blocks[t]
        for j in range(k, n_full):
            s = j - t
            for node in tmpl:
                args, kwargs = map_aggregate(
                    (node.args, node.kwargs),
                    lambda x: self.counterpart(x, s, lookup) if isinstance(x, torch.fx.Node)
                    and (x in self.pos or x in self.ph_block) else (new[x] if isinstance(
                        x, torch.fx.Node) else x))
                out = g.create_node(node.op, node.target, tuple(args), dict(kwargs),
                                    name=self.moved_name(node.name, s), type_expr=node.type)
                out.meta = self.moved_meta(node, t, s)
                blocks_new[j].append(out)

        def late(x):      # the epilogue reads the last block: the full model's last one
            if not isinstance(x, torch.fx.Node):
                return x
            if x in self.pos or x in self.ph_block:
                b = self.pos[x][0] if x in self.pos else self.ph_block[x][0]
                if b != t:
                    raise _Refuse(f"the epilogue reads {x.name} of block {b}, not the last")
                return self.counterpart(x, extra, lookup)
            return new[x]

        renamed = {}
        for node in self.epi:
            args, kwargs = map_aggregate((node.args, node.kwargs), late)
            name = self.moved_name(node.name, extra)
            out = g.create_node(node.op, node.target, tuple(args), dict(kwargs), name=name,
                                type_expr=node.type)
            out.meta = self.moved_meta(node, 0, 0)
            if "torch_fn" in out.meta:
                base, num = _split(out.meta["torch_fn"][0], _FN)
                out.meta["torch_fn"] = (f"{base}_{num + extra * self.fn_delta.get(base, 0)}",
                                        out.meta["torch_fn"][1])
            if out.name != name:
                raise _Refuse(f"epilogue node {node.name} would be named {out.name}")
            new[node] = out
            renamed[node.name] = name
        out_args = map_aggregate(self.out.args, late)
        o = g.create_node("output", "output", tuple(out_args), name=self.out.name)
        o.meta = dict(self.out.meta)

        # the namespace export leaves behind: the shallow one, its late names moved on, the
        # placeholders traced as arg<i>_1
        old_ns, ns = self.g._graph_namespace, g._graph_namespace
        used = old_ns._used_names - set(renamed)
        count = dict(old_ns._base_count)
        for node in g.nodes:
            if node.op == "placeholder":
                continue
            if node.name not in used:
                used.add(node.name)
                base, num = _split(node.name)
                if base in self.delta:
                    count[base] = num
        for i in range(len(specs)):
            used.add(f"arg{i}_1")
            count[f"arg{i}"] = 1
        ns._used_names, ns._base_count = used, count
        back = {v: k for k, v in new.items()}
        ph_i = 0
        for node in g.nodes:
            if node.op == "placeholder":
                ns._obj_to_name[node] = f"arg{ph_i}_1"
                ph_i += 1
            elif node in back:
                ns._obj_to_name[node] = old_ns._obj_to_name.get(back[node], node.name)
        gm = self.gm
        gm.graph = g
        out_specs = [OutputSpec(s.kind, TensorArgument(renamed.get(s.arg.name, s.arg.name))
                                if isinstance(s.arg, TensorArgument) else s.arg, s.target)
                     for s in self.sig.output_specs]
        sig = ExportGraphSignature(input_specs=specs, output_specs=out_specs)
        return StampedProgram(gm, sig, self.ep.constants, self.ep.call_spec, extra)


def _same(a, b) -> bool:
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        return a is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[x], b[x]) for x in a)
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - not comparable: not the same
        return False


def _val_sig(v):
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.device,
                v.requires_grad)
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_val_sig(x) for x in v))
    if isinstance(v, dict):
        return (dict, tuple((k, _val_sig(x)) for k, x in sorted(v.items())))
    if isinstance(v, (int, float, bool, str, type(None))):
        return (type(v), v)
    if isinstance(v, torch.SymInt):
        raise _Refuse("symbolic shapes")
    try:
        hash(v)
        return (type(v), v)
    except TypeError:
        raise _Refuse(f"value of type {type(v).__name__}") from None
