"""The profiler: real timings of ATen calls on this CPU, valid integer inputs, the on-disk
cache, and its use by the planner (profiled where measured, roofline elsewhere)."""
import json

import pytest
import torch

import autopar
from autopar.cost_models.profile import PeakMemory, Profiler, default_cache_dir
from autopar.sharding.registry import TensorMeta
from examples.models import gpt_factory

aten = torch.ops.aten
F32, I64 = torch.float32, torch.int64


def T(*shape, dtype=F32):
    return TensorMeta(tuple(shape), dtype)


def prof(tmp_path, **kw):
    return Profiler("cpu", cache_dir=tmp_path, threads=1, repeats=3, min_repeat_s=5e-4,
                    progress=False, **kw)


def test_times_forward_and_backward_and_caches_on_disk(tmp_path):
    p = prof(tmp_path)
    x, w, b = T(64, 128), T(256, 128), T(256)
    small = p.node_time(aten.linear.default, [x, w, b], [T(64, 256)], (x, w, b), {})
    x2 = T(512, 128)
    big = p.node_time(aten.linear.default, [x2, w, b], [T(512, 256)], (x2, w, b), {})
    assert small[0] > 0 and small[1] > 0
    assert big[0] > 2 * small[0]             # 8x the FLOPs: clearly slower, whatever the noise
    assert p.measured == 2 and not p.failures
    p.save()
    table = json.loads(p.path.read_text())["times"]
    assert len(table) == 2 and all("aten.linear.default" in k and "cpu-t1" in k for k in table)
    again = prof(tmp_path)                   # a new process would read the same file
    assert again.node_time(aten.linear.default, [x, w, b], [T(64, 256)], (x, w, b), {}) == small
    assert again.measured == 0


def test_integer_inputs_are_valid_for_the_call(tmp_path):
    p = prof(tmp_path)
    wte, idx = T(1000, 32), T(4, 16, dtype=I64)
    assert p.node_time(aten.embedding.default, [wte, idx], [T(4, 16, 32)], (wte, idx), {})
    logits, target = T(64, 5000), T(64, dtype=I64)
    assert p.node_time(aten.cross_entropy_loss.default, [logits, target], [T()], (logits, target), {})
    src, ind = T(7, 300), T(20, dtype=I64)
    assert p.node_time(aten.index_select.default, [src, ind], [T(20, 300)], (src, 0, ind), {})
    assert p.failures == {}


def test_no_time_for_views_big_calls_and_failures(tmp_path):
    p = prof(tmp_path, max_bytes=1e6)
    x = T(8, 8)
    assert p.node_time(aten.view.default, [x], [T(64)], (x, [64]), {}) is None
    big = T(1024, 1024)
    assert p.node_time(aten.relu.default, [big], [big], (big,), {}) is None
    a, b = T(4, 5), T(6, 7)                  # mm of mismatched shapes raises: no time, a reason
    assert p.node_time(aten.mm.default, [a, b], [T(4, 7)], (a, b), {}) is None
    assert len(p.failures) == 1


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    assert Profiler("cpu", progress=False).path.parent == tmp_path / "c"


def test_planner_uses_profiled_times(tmp_path):
    ex = gpt_factory(batch=8)
    p = prof(tmp_path)
    with p:
        profiled = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                                cluster="cpu:2", data=2, profiler=p)
    assert p.measured > 10 and p.path.exists()
    roofline = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                            cluster="cpu:2", data=2)
    assert profiled.estimate.compute_s != roofline.estimate.compute_s
    p2 = prof(tmp_path)
    again = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                         cluster="cpu:2", data=2, profiler=p2)
    assert p2.measured == 0                  # all from the cache
    assert again.estimate.compute_s == pytest.approx(profiled.estimate.compute_s)


def test_pipeline_planner_uses_profiled_times(tmp_path):
    """``pipeline=`` plans price their stages with the profiler too."""
    ex = gpt_factory(batch=8)
    pins = dict(pipeline=2, schedule="1f1b", micro_batch_size=2)
    p = prof(tmp_path)
    with p:
        profiled = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                                cluster="cpu:2", profiler=p, **pins)
    assert p.measured > 10
    roofline = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                            cluster="cpu:2", **pins)
    assert profiled.estimate.stage_times_s != roofline.estimate.stage_times_s


def test_peak_memory_counts_live_tensors():
    x = torch.randn(256, 256, requires_grad=True)
    with PeakMemory() as m:
        y = (x * 2).relu()                   # two 256 KB results (x*2 is saved by nothing)
        del y
        z = x + 1
    assert m.peak_bytes == 2 * 256 * 256 * 4
    assert m.current_bytes == 256 * 256 * 4  # z
    del z
