"""GPUs without a GPU: the device comes from one place (``autopar/device.py``), the cluster
from the devices a job sees, the process group after the CUDA device is set.

- No runtime module (``autopar/runtime``, ``autopar/ops``, ``passes``) names a device type
  outside ``autopar/device.py`` (parsed with ``ast``; ThreadComm's documented CPU is the one
  allowed literal).
- ``parallelize()`` without ``cluster=`` on a (monkeypatched) CUDA machine derives a cluster
  ``parse_cluster`` and the solver accept: A100 / H100 names give the presets, an unknown
  GPU a measured description.
- ``_dist_world`` sets the CUDA device before it creates the process group, with NCCL on
  CUDA and gloo on CPU.
"""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch
import torch.distributed as dist

import autopar.api as api
import autopar.device as device_mod
from autopar.cost_models import local_devices
from autopar.cost_models.hardware import parse_cluster

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNTIME_DIRS = ("autopar/runtime", "autopar/ops", "passes")
THE_PLACE = "autopar/device.py"
# (file, class or function, literal): literals allowed outside the one place, each a
# documented exception
ALLOWED = {("autopar/ops/comm.py", "ThreadComm", "cpu")}
DEVICE_TYPES = {"cpu", "cuda", "mps", "xpu", "hpu"}     # where a rank runs ("meta" is no such place)


def _device_literals(path: pathlib.Path):
    """(enclosing class/function, literal, line) of every string constant naming a device
    type (alone or as ``"cuda:0"``), docstrings aside."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.ClassDef, ast.FunctionDef,
                                                     ast.AsyncFunctionDef)) and scope is None else scope
            if (isinstance(child, ast.Constant) and isinstance(child.value, str)
                    and id(child) not in docstrings
                    and child.value.split(":")[0].lower() in DEVICE_TYPES):
                found.append((scope, child.value.split(":")[0].lower(), child.lineno))
            visit(child, inner)
    visit(tree, None)
    return found


def _runtime_files():
    for d in RUNTIME_DIRS:
        yield from sorted((ROOT / d).glob("*.py"))


def test_runtime_names_no_device_type_outside_the_one_place():
    bad, allowed_seen = [], set()
    files = list(_runtime_files())
    assert len(files) >= 10, files
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        for scope, literal, line in _device_literals(path):
            if (rel, scope, literal) in ALLOWED:
                allowed_seen.add((rel, scope, literal))
            else:
                bad.append(f"{rel}:{line} ({scope}) names {literal!r}")
    assert not bad, ("device types belong in autopar/device.py (rank_device, mesh_device, "
                     "backend_for, object_device):\n" + "\n".join(bad))
    assert allowed_seen == ALLOWED, f"stale allow-list entries: {ALLOWED - allowed_seen}"
    # the one place does name them
    assert {lit for _, lit, _ in _device_literals(ROOT / THE_PLACE)} >= {"cpu", "cuda"}


def test_the_scan_catches_a_literal(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('"""cpu in a docstring is fine"""\nimport torch\n'
                 'def f():\n    return torch.zeros(1, device="cuda:0"), torch.device("cpu")\n')
    assert [(s, lit) for s, lit, _ in _device_literals(p)] == [("f", "cuda"), ("f", "cpu")]


# ---- the cluster from the devices seen --------------------------------------------------
def _fake_cuda(monkeypatch, name: str, count: int, memory: float = 80 * 2**30):
    class Props:
        total_memory = memory
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=None: Props())


@pytest.mark.parametrize("name,key", [
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100 80GB PCIe", "a100"),
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 NVL", "h100"), ("NVIDIA H200", "h200"),
    ("NVIDIA A10", None), ("NVIDIA RTX A1000", None), ("Tesla V100-SXM2-16GB", None),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_preset_key(name, key):
    assert local_devices.preset_key(name) == key


def test_no_cuda_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert api._local_cluster(4) == "cpu:4"
    assert parse_cluster(api._local_cluster(4)).world_size == 4


@pytest.mark.parametrize("name,world,local,expect", [
    ("NVIDIA A100-SXM4-80GB", 8, "8", "1x8xA100"),
    ("NVIDIA H100 80GB HBM3", 16, "8", "2x8xH100"),
    ("NVIDIA H100 80GB HBM3", 2, None, "1x2xH100"),      # no torchrun env: devices seen
])
def test_known_gpu_is_its_preset(monkeypatch, name, world, local, expect):
    _fake_cuda(monkeypatch, name, count=8)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    cl = api._local_cluster(world)
    assert cl.name == expect
    assert parse_cluster(cl) is cl and cl.world_size == world
    again = parse_cluster(cl.name)      # the name is a preset the parser reads back
    assert (again.nodes, again.devices_per_node, again.device.peak_flops) == (
        cl.nodes, cl.devices_per_node, cl.device.peak_flops)


def test_a100_40gb_keeps_its_memory(monkeypatch):
    _fake_cuda(monkeypatch, "NVIDIA A100-SXM4-40GB", count=4, memory=40 * 2**30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cl = api._local_cluster(4)
    assert cl.name == "1x4xA100" and cl.device.memory_bytes == 40 * 2**30


def test_unknown_gpu_is_measured(monkeypatch):
    """An unknown device name: peaks measured on the device (here the measurement runs on
    the CPU in place of the fake GPU), a Cluster the solver takes as is."""
    _fake_cuda(monkeypatch, "NVIDIA GeForce RTX 4090", count=2, memory=24 * 2**30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    real = local_devices.measured_device
    seen = []

    def on_cpu(dev, name, n=256):
        seen.append((dev.type, name))
        return real(torch.device("cpu"), name, n=n)
    monkeypatch.setattr(local_devices, "measured_device", on_cpu)
    cl = api._local_cluster(2)
    assert seen == [("cuda", "NVIDIA GeForce RTX 4090")]
    assert parse_cluster(cl) is cl and cl.world_size == 2 and cl.nodes == 1
    assert cl.device.name == "NVIDIA-GeForce-RTX-4090"
    assert all(v > 1e6 for v in cl.device.peak_flops.values()) and cl.device.mem_bandwidth > 1e6
    assert cl.intra == local_devices.GENERIC_INTRA


def test_parallelize_plans_on_the_derived_cluster(monkeypatch):
    """``parallelize()`` without ``cluster=`` on a fake 2-GPU H100 machine hands the solver
    the derived preset (not a string the parser rejects), and that cluster plans."""
    from examples.models import EXAMPLES
    from autopar.ops.comm import ThreadWorld

    class Stop(Exception):
        pass
    seen = []

    def spy(*a, **kw):
        seen.append(kw["cluster"])
        raise Stop
    ex = EXAMPLES["mlp"]()
    with monkeypatch.context() as m:
        m.setattr(api, "solve", spy)
        _fake_cuda(m, "NVIDIA H100 80GB HBM3", count=2)
        m.setenv("LOCAL_WORLD_SIZE", "2")
        with pytest.raises(Stop):
            api.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                            comm=ThreadWorld((2,)).comm(0), data=2)
    assert [c.name for c in seen] == ["1x2xH100"]
    p = api.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=seen[0], data=2)
    assert p.cluster == "1x2xH100" and p.mesh_shape == (2,)


# ---- the process group after the device ---------------------------------------------------
@pytest.mark.parametrize("cuda", [False, True])
def test_dist_world_sets_the_device_before_the_group(monkeypatch, cuda):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2 if cuda else 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(dist, "is_initialized", lambda: bool([c for c in calls if c[0] == "init"]))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout=None: calls.append(("init", backend)))
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert api._dist_world() == 4
    if cuda:
        assert calls == [("set_device", 1), ("init", "nccl")]
    else:
        assert calls == [("init", "gloo")]


def test_device_helpers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_mod.rank_device() == torch.device("cpu")
    assert device_mod.backend_for(torch.device("cpu")) == "gloo"
    assert device_mod.backend_for(torch.device("cuda", 0)) == "nccl"
    assert device_mod.object_device(torch.device("cpu")) is None
    assert device_mod.object_device(torch.device("cuda", 2)) == torch.device("cuda", 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert device_mod.mesh_device("cuda") == torch.device("cuda", 3)
    assert device_mod.mesh_device("cpu") == torch.device("cpu")


def test_more_ranks_than_gpus_need_the_sharing_switch(monkeypatch):
    """Two local ranks on a one-GPU node: rank 1 is refused with the fix, unless
    ``AUTOPAR_SHARE_GPUS=1`` puts it on GPU 0 over gloo (NCCL refuses two ranks a GPU)."""
    set_to = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv(device_mod.SHARE_GPUS_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK 1 but this node has 1 CUDA device.*"
                                           r"--nproc-per-node 1.*AUTOPAR_SHARE_GPUS=1"):
        device_mod.rank_device()
    assert set_to == []
    monkeypatch.setenv(device_mod.SHARE_GPUS_ENV, "1")
    assert device_mod.rank_device() == torch.device("cuda", 0) and set_to == [0]
    assert device_mod.backend_for(torch.device("cuda", 0)) == "gloo"
    assert device_mod.object_device(torch.device("cuda", 0)) is None


# ---- tensors the model creates --------------------------------------------------------------
def test_created_tensors_follow_the_rank_device():
    """GPT's positions (``aten.arange(..., device=cpu)`` in the export) are created on the
    rank's device in every per-rank program: ``passes.place_on_device`` run by
    ParallelModule with ``comm.device``. Here a fake rank device ("meta") shows the rewrite;
    with the CPU it is a no-op and the program still runs."""
    import copy

    from autopar.capture import capture
    from autopar.passes.place_on_device import place_on
    from examples.models import EXAMPLES

    ex = EXAMPLES["gpt"]()
    cap = capture(ex.model, ex.inputs, ex.loss_fn, target=ex.target)

    def devices(gm):
        return [n.kwargs["device"] for n in gm.graph.nodes if "device" in n.kwargs]
    assert devices(cap.gm) and all(torch.device(d).type == "cpu" for d in devices(cap.gm))
    gm = copy.deepcopy(cap.gm)
    assert place_on(gm, torch.device("cpu")) == 0
    meta = torch.device("meta")
    assert place_on(gm, meta) == len(devices(cap.gm))
    assert all(d == meta for d in devices(gm)) and "meta" in gm.code


def test_moves_to_the_capture_device_follow_the_rank_device():
    """transformers' Llama moves its rotary ``inv_freq`` to the input's device: export
    records ``aten.to.device(x, cpu, ...)`` with the device positional, which ran the
    rotary product on the CPU beside CUDA tensors on the first GPU run (2026-11-26, H100)."""
    import copy

    transformers = pytest.importorskip("transformers")
    from autopar.capture import capture
    from autopar.passes.place_on_device import place_on

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager")
    cap = capture(model, (torch.randint(0, 64, (2, 8)),))

    def positional(gm):
        return [a for n in gm.graph.nodes for a in n.args if isinstance(a, torch.device)]
    assert positional(cap.gm) and all(d.type == "cpu" for d in positional(cap.gm))
    gm = copy.deepcopy(cap.gm)
    meta = torch.device("meta")
    place_on(gm, meta)
    assert all(d == meta for d in positional(gm))


def test_parallel_module_places_its_programs(monkeypatch):
    """ParallelModule calls place_on on every program with its device (a pass of
    ``autopar.runtime.program_passes``)."""
    import autopar.runtime.program_passes as pmod
    from autopar.ops.comm import ThreadWorld
    from examples.models import EXAMPLES

    seen = []
    real = pmod.place_on
    monkeypatch.setattr(pmod, "place_on", lambda gm, dev: seen.append(dev) or real(gm, dev))
    ex = EXAMPLES["gpt"]()
    comm = ThreadWorld((1,)).comm(0)
    pm = api.parallelize(ex.model, ex.inputs, ex.loss_fn, target=ex.target, comm=comm,
                         cluster="cpu:1")
    assert seen == [comm.device, comm.device]          # train and forward
    loss = pm.train_step(*ex.inputs, target=ex.target)
    assert torch.isfinite(loss)


_BACKWARD_ON_ANOTHER_THREAD = r"""
import os, threading, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from autopar.ops import collectives
from autopar.ops.comm import DistComm, use_comm
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
comm = DistComm(init_device_mesh("cpu", (1,)))
x = torch.randn(4, requires_grad=True)
with use_comm(comm):
    y = collectives.all_reduce(x * 2, 0, grad_partial=True)    # backward all-reduces too
got = []
t = threading.Thread(target=lambda: got.append(torch.autograd.grad(y.sum(), x)[0]))
t.start(); t.join()
assert got and torch.equal(got[0], torch.full((4,), 2.0)), got
print("backward on another thread: ok")
dist.destroy_process_group()
"""


def test_backward_on_another_thread_finds_the_process_communicator():
    """On a GPU the autograd engine runs backward on a thread of its own per device, where no
    ``use_comm`` block is active: the collectives' backward (and the gradient buckets) read
    the process's own rank's communicator there (``ops.comm._process_comm``). Here a
    thread of ours runs the backward, on one gloo rank in a fresh process."""
    import os
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PORT=str(port), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _BACKWARD_ON_ANOTHER_THREAD], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_shared_gpus_refuse_plans_that_send(monkeypatch):
    """On ranks sharing a GPU (gloo over CUDA tensors, whose send / recv fails) a pipelined
    plan is refused before it runs, naming the fix; an unpipelined one passes."""
    from examples.models import EXAMPLES
    from autopar.plan import PlanError
    ex = EXAMPLES["gpt"]()
    piped = api.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:2", pipeline=2,
                     micro_batch_size=1, schedule="gpipe")
    flat = api.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="cpu:2", data=2)
    monkeypatch.setattr(api, "rank_device", lambda: torch.device("cuda", 0))
    api._check_shared_gpus(piped)                # not shared: nothing to refuse
    monkeypatch.setenv(device_mod.SHARE_GPUS_ENV, "1")
    with pytest.raises(PlanError, match=r"pipeline stages send tensors.*pipeline=1.*unset the variable"):
        api._check_shared_gpus(piped)
    api._check_shared_gpus(flat)
