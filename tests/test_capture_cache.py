"""The capture cache (issue 40, item 4; ``autopar/capture/cache.py``): planning a model again
reads its graph from disk instead of exporting it, and the plan is the same plan (digest);
the key changes with the shapes, dtypes and structure; a corrupt entry is ignored and
replaced; ``AUTOPAR_CACHE=0`` and ``cache=False`` turn it off. Every test caches under its
own ``tmp_path``. The progress line (item 5): the CLI's ``--quiet`` prints none."""
from __future__ import annotations

from pathlib import Path

import torch
from click.testing import CliRunner

import autopar
from autopar.capture import cache, capture, export, fingerprint
from autopar.cli import cli
from autopar.solver import progress
from autopar.solver.driver import solve
from examples.models import EXAMPLES

CLUSTER = "1x4xH100"     # a GPU cluster: priced from its datasheet, not this machine's load


def _counting(monkeypatch) -> list:
    """Count the exports: ``export._capture`` is what a cache hit skips."""
    calls = []
    real = export._capture

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(export, "_capture", spy)
    return calls


def _cache_at(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("AUTOPAR_CACHE", raising=False)


def _entries(tmp_path) -> list:
    return sorted((tmp_path / "captures").glob("*.pt"))


def _plan(ex, pins=None, **kw):
    return solve(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=CLUSTER,
                 world_size=4, pins=pins or {}, **kw).plan


def test_hit_skips_capture_and_gives_the_same_plan(monkeypatch, tmp_path):
    """The second planning of the same model (a new instance, as another process builds it)
    does not export; its plan's digest is the uncached plan's, and ``plan.solver`` says
    where the graph came from. The llama example: stamped layers, a namespace that later
    passes name nodes from. On a pinned 2 x 2 mesh: every node priced on both axes, one ILP
    (the free search's other meshes cost 4x the time and read the same graph)."""
    _cache_at(monkeypatch, tmp_path)
    calls = _counting(monkeypatch)
    mesh = {"data": 2, "tensor": 2}
    fresh = _plan(EXAMPLES["llama"](), mesh, cache=False)
    assert len(calls) == 1 and fresh.solver.capture_cache == "off" and not _entries(tmp_path)
    first = _plan(EXAMPLES["llama"](), mesh)
    assert len(calls) == 2 and first.solver.capture_cache == "miss"
    assert len(_entries(tmp_path)) == 1
    again = _plan(EXAMPLES["llama"](), mesh)
    assert len(calls) == 2, "the cached graph was exported again"
    assert again.solver.capture_cache == "hit"
    assert fresh.digest() == first.digest() == again.digest()
    assert fresh.fingerprint == again.fingerprint


def test_cached_graph_equals_the_exported_one(monkeypatch, tmp_path):
    """Node by node: name, op, target, arguments, meta keys, and each value's shape, stride,
    dtype and requires_grad; the captured fields around the graph too."""
    _cache_at(monkeypatch, tmp_path)
    ex = EXAMPLES["gpt"]()
    with cache.caching() as use:
        a = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
        b = capture(ex.model, ex.inputs, ex.loss_fn, ex.target)
    assert (use.captures, use.hits, use.stored) == (2, 1, 1)
    assert a is not b and fingerprint(a) == fingerprint(b)

    def sig(v):
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), v.stride(), v.dtype, v.device.type, v.requires_grad)
        if isinstance(v, (list, tuple)):
            return tuple(sig(x) for x in v)
        return v
    na, nb = list(a.gm.graph.nodes), list(b.gm.graph.nodes)
    assert len(na) == len(nb)
    for x, y in zip(na, nb):
        assert (x.name, x.op, x.target, str(x.args), str(x.kwargs)) == \
               (y.name, y.op, y.target, str(y.args), str(y.kwargs))
        assert set(x.meta) == set(y.meta)
        assert sig(x.meta.get("val")) == sig(y.meta.get("val"))
        assert x.meta.get("nn_module_stack") == y.meta.get("nn_module_stack")
    for f in ("params", "buffers", "inputs", "n_model_inputs", "loss", "output", "has_loss",
              "takes_target", "method"):
        assert getattr(a, f) == getattr(b, f), f
    assert str(a.output_spec) == str(b.output_spec)
    # a new node is named as on the exported graph (the namespace's counters came along)
    for cap in (a, b):
        first = next(n for n in cap.gm.graph.nodes if n.op == "call_function")
        with cap.gm.graph.inserting_after(first):
            new = cap.gm.graph.call_function(first.target, first.args, first.kwargs)
        cap.new_name = new.name
    assert a.new_name == b.new_name


def test_key_follows_shapes_dtypes_and_structure():
    ex = EXAMPLES["mlp"]()
    key = cache.capture_key(ex.model, ex.inputs, ex.loss_fn, ex.target, True, None)
    assert key is not None
    # the same model built again, with other weights: the same key
    same = EXAMPLES["mlp"](seed=3)
    assert cache.capture_key(same.model, same.inputs, same.loss_fn, same.target, True, None) == key
    others = {
        "batch": EXAMPLES["mlp"](batch=16),
        "hidden": EXAMPLES["mlp"](hidden=32),
    }
    keys = {name: cache.capture_key(e.model, e.inputs, e.loss_fn, e.target, True, None)
            for name, e in others.items()}
    keys["input dtype"] = cache.capture_key(ex.model, (ex.inputs[0].double(),), ex.loss_fn,
                                            ex.target, True, None)
    keys["weights dtype"] = cache.capture_key(EXAMPLES["mlp"]().model.to(torch.bfloat16),
                                              ex.inputs, ex.loss_fn, ex.target, True, None)
    keys["eval mode"] = cache.capture_key(EXAMPLES["mlp"]().model.eval(), ex.inputs, ex.loss_fn,
                                          ex.target, True, None)
    keys["no loss"] = cache.capture_key(ex.model, ex.inputs, None, None, True, None)
    keys["not stamped"] = cache.capture_key(ex.model, ex.inputs, ex.loss_fn, ex.target, False, None)
    keys["context layout"] = cache.capture_key(ex.model, ex.inputs, ex.loss_fn, ex.target, True, 2)
    grown = EXAMPLES["mlp"]().model
    grown.extra = torch.nn.Linear(2, 2)       # another module in the tree
    keys["structure"] = cache.capture_key(grown, ex.inputs, ex.loss_fn, ex.target, True, None)
    assert all(k is not None for k in keys.values()), keys
    assert len(set(keys.values()) | {key}) == len(keys) + 1, keys
    # a hook runs code the key cannot see: not cached
    hooked = EXAMPLES["mlp"]().model
    hooked.register_forward_hook(lambda m, i, o: o)
    assert cache.capture_key(hooked, ex.inputs, ex.loss_fn, ex.target, True, None) is None


def test_corrupt_or_stale_entry_is_ignored_and_replaced(monkeypatch, tmp_path):
    _cache_at(monkeypatch, tmp_path)
    calls = _counting(monkeypatch)
    ex = EXAMPLES["mlp"]()
    first = _plan(ex)
    (entry,) = _entries(tmp_path)
    good = entry.read_bytes()
    for bad in (b"not a cache entry", good[: len(good) // 2],
                good.replace(b'"format": 1', b'"format": 0', 1)):
        entry.write_bytes(bad)
        got = _plan(EXAMPLES["mlp"]())
        assert got.solver.capture_cache == "miss" and got.digest() == first.digest()
        assert entry.read_bytes() == good or cache.load(entry.stem) is not None
    assert len(calls) == 4
    assert _plan(EXAMPLES["mlp"]()).solver.capture_cache == "hit" and len(calls) == 4


def test_off_by_env_and_by_argument(monkeypatch, tmp_path):
    _cache_at(monkeypatch, tmp_path)
    calls = _counting(monkeypatch)
    ex = EXAMPLES["mlp"]()
    monkeypatch.setenv("AUTOPAR_CACHE", "0")
    for _ in range(2):
        assert _plan(ex).solver.capture_cache == "off"
    assert len(calls) == 2 and not _entries(tmp_path)
    monkeypatch.delenv("AUTOPAR_CACHE")
    for _ in range(2):
        p = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=CLUSTER,
                         world_size=4, cache=False)
        assert p.solver.capture_cache == "off"
    assert len(calls) == 4 and not _entries(tmp_path)


def test_cli_says_it_used_the_cache_and_quiet_prints_no_progress(monkeypatch, tmp_path):
    _cache_at(monkeypatch, tmp_path)
    args = ["plan", "examples.models:mlp_factory", "--cluster", CLUSTER]
    first = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert first.exit_code == 0, first.output
    assert "capturing the training graph" in first.stderr and "capture cache" not in first.stderr
    again = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert again.exit_code == 0, again.output
    assert "read from the capture cache" in again.stderr
    assert "(from the cache)" in again.stdout          # the summary's solver line
    quiet = CliRunner().invoke(cli, args + ["--quiet"], catch_exceptions=False)
    assert quiet.exit_code == 0, quiet.output
    assert quiet.stderr == "" and "solver:" in quiet.stdout
    fresh = CliRunner().invoke(cli, args + ["--no-cache", "-q"], catch_exceptions=False)
    assert fresh.exit_code == 0 and "(from the cache)" not in fresh.stdout


def test_search_stages_reach_the_reporter():
    """The free search tells the open reporter each stage it begins and ends, with the best
    step so far once there is one (what the CLI's progress line shows)."""
    seen = []
    ex = EXAMPLES["mlp"]()
    with progress.reporting(lambda *a: seen.append(a)):
        p = _plan(ex, cache=False)
    began = [s for s, sec, _ in seen if sec is None]
    ended = [s for s, sec, _ in seen if sec is not None]
    assert began[0] == "unpipelined" and "unpipelined" in ended
    assert set(began) == set(ended)
    bests = [b for _, sec, b in seen if sec is not None and b is not None]
    assert bests and min(bests) >= p.estimate.step_time_s * (1 - 1e-12)


def test_ranks_run_a_plan_made_on_cached_graphs(monkeypatch, tmp_path):
    """``autopar.parallelize`` planning on every rank (thread ranks): the second job reads
    each rank's graph from the cache, exports nothing, and its ranks still compute what one
    device computes (loss, every gradient, the weights after the step). Tensor parallel on
    2 ranks: the cached graph sharded and its collectives inserted, one ILP a rank."""
    import copy
    from autopar.ops.comm import ThreadWorld
    from equivalence import compare, parallel_run, reference_run
    _cache_at(monkeypatch, tmp_path)
    calls = _counting(monkeypatch)
    ex = EXAMPLES["llama"]()
    ref = reference_run(ex.model, ex.inputs, ex.target, ex.loss_fn)
    for job in ("first", "second"):
        before = len(calls)
        world = ThreadWorld((2,))
        copies = [copy.deepcopy(ex.model) for _ in range(world.world)]

        def body(comm):
            pm = autopar.parallelize(copies[comm.rank], ex.inputs, ex.loss_fn, target=ex.target,
                                     cluster="cpu:2", comm=comm, tensor=2)
            return parallel_run(pm, ex.inputs, ex.target)
        for rank, got in enumerate(world.run(body)):
            compare(ref, got, f"{job} job, rank {rank}")
        if job == "first":
            assert len(calls) > before and _entries(tmp_path)
        else:
            assert len(calls) == before, "the second job exported again"


def test_the_off_switch_is_not_a_folder_for_the_machine_figures(monkeypatch):
    """``AUTOPAR_CACHE=0`` turns the capture cache off; the machine figures and the profiler,
    which read the same variable as a folder, keep their default folder (not ``./0``)."""
    from autopar.cost_models.machine import default_cache_dir
    for off in ("0", "off", "False"):
        monkeypatch.setenv("AUTOPAR_CACHE", off)
        assert default_cache_dir() == Path.home() / ".cache" / "autopar"
    monkeypatch.setenv("AUTOPAR_CACHE", "/tmp/somewhere")
    assert str(default_cache_dir()) == "/tmp/somewhere"


def test_key_follows_the_attention_implementation():
    """transformers keeps ``_attn_implementation`` out of its config JSON; eager, SDPA and
    flex attention are different graphs (CI caught a Llama built with SDPA planned on the
    eager one's cached graph, and flex attention's refusal skipped)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    keys = set()
    for impl in ("eager", "sdpa", "flex_attention"):
        cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
                          attn_implementation=impl)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        tokens = torch.zeros(2, 4, dtype=torch.long)
        keys.add(cache.capture_key(model, (tokens,), None, None, True, None))
    assert None not in keys and len(keys) == 3
