"""Sharded checkpoints (``autopar.checkpoint``) across plans and world sizes.

Three torchrun launches (``tests/checkpoint_worker.py``), the checkpoint directories passed
from one to the next: 2 ranks save, 4 ranks load them under other plans (and save), 2 ranks
load those. Each (A, B) pair: the small GPT (tied embedding / head, fused q/k/v) trains 2
AdamW steps under plan A, saves, loads under plan B on the other world size (into other
initial weights, an optimizer with another lr), trains 2 more; every parameter and buffer
equals 4 uninterrupted single-device AdamW steps, the loaded weights equal the saved ones
bitwise and the loaded moments equal one device's. Every save is also exported to a plain
state dict that a fresh model's ``load_state_dict`` (strict) takes, equal to
``pm.full_state_dict()``; an imported plain state dict loads under tensor parallelism.

Two of the plans hold GPT's fused q/k/v weight as a strided shard S(0/3) (saved as 3
blocks per rank, not one DTensor chunk), one saves and one loads.

Single process: each saved tensor's chunks cover it exactly once (no chunk written twice,
none missing); the CLI's export and import; bad paths.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from autopar.checkpoint import CheckpointError, export_checkpoint, import_state_dict, load_checkpoint
from autopar.cli import cli
from autopar.placement import Shard
from autopar.runtime.dcp_state import blocks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PP = {"pipeline": 2, "micro_batch_size": 2}

# (pair id, plan A, world A, plan B, world B)
PAIRS = [
    ("data2@2-to-tensor2xdata2@4", {"data": 2}, 2, {"data": 2, "tensor": 2}, 4),
    ("tensor2-strided@2-to-zero3@4", {"tensor": 2, "strided": True}, 2, {"data": 4, "zero": 3}, 4),
    ("zero3@4-to-pipeline2@2", {"data": 4, "zero": 3}, 4, {**PP, "schedule": "gpipe"}, 2),
    ("pipeline2xdata2@4-to-data2@2", {**PP, "data": 2, "schedule": "1f1b"}, 4, {"data": 2}, 2),
    ("tensor2xdata2@4-to-tensor2-strided@2", {"data": 2, "tensor": 2}, 4, {"tensor": 2, "strided": True}, 2),
]


def _torchrun(nproc: int, cases: list[dict], out) -> tuple[dict, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           os.path.join(HERE, "checkpoint_worker.py"), json.dumps(cases), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUTOPAR_CASE_TIMEOUT": "180"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    results = json.loads(out.read_text()) if out.exists() else []
    noise = ("Warning", "return func(")
    log = "\n".join(x for x in proc.stderr.splitlines() if not any(w in x for w in noise))
    failed = "" if proc.returncode == 0 else f"torchrun failed ({proc.returncode}):\n{log[-8000:]}"
    return {r["case"]["id"]: r for r in results}, failed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case's result, from the three launches (2 ranks, 4 ranks, 2 ranks)."""
    tmp = tmp_path_factory.mktemp("ckpt")

    def case(kind, pair, pins):
        pins = dict(pins)
        strided = pins.pop("strided", False)     # the hand-made S(0/3) plan (checkpoint_worker)
        return {"id": f"{kind}-{pair}", "kind": kind, "model": "gpt", "pins": pins,
                "strided": strided, "dir": str(tmp / pair)}
    launches: list[list[dict]] = [[], [], []]      # on 2, 4, then 2 ranks
    for pair, a, wa, b, wb in PAIRS:
        # plan A saves in the first launch of its world size, plan B loads in the next launch
        i = 0 if wa == 2 else 1
        launches[i].append(case("save", pair, a))
        launches[i + 1].append(case("load", pair, b))
    launches[0].append({**case("import", "import", {"tensor": 2}), "id": "import-tensor2@2"})
    # fp32 -> bf16: a ZeRO-3 checkpoint of 4 ranks into a bf16 data=2 plan (fp32 masters)
    launches[2].append({**case("load", PAIRS[2][0], {"data": 2, "precision": "bf16"}),
                        "id": "load-fp32-to-bf16"})
    results, failures = {}, []
    for k, (nproc, cases) in enumerate(zip((2, 4, 2), launches)):
        got, failed = _torchrun(nproc, cases, tmp / f"launch{k}.json")
        results.update(got)
        if failed:
            failures.append(failed)
    return results, failures, tmp


def _result(runs, cid):
    results, failures, _ = runs
    if cid not in results:
        pytest.fail(f"case {cid} did not run: {' / '.join(failures)[-4000:]}")
    r = results[cid]
    assert r["ok"], f"{cid}: {r['error']}\n{r.get('trace', '')}"
    return r


@pytest.mark.parametrize("pair", [p[0] for p in PAIRS])
def test_save_then_load_under_another_plan(runs, pair):
    saved = _result(runs, f"save-{pair}")
    loaded = _result(runs, f"load-{pair}")
    print(pair, "A err", saved["err_after_2"], "B moments", loaded["moment_err"],
          "B err", loaded["err"], loaded["worst_param"], "mesh", saved["mesh"], "->", loaded["mesh"])
    assert loaded["err"] < 5e-3


def test_fp32_checkpoint_into_a_bf16_plan(runs):
    """Weights load bitwise, moments as one device's (checked in the worker); the 2 bf16
    steps after it are reported, not compared."""
    r = _result(runs, "load-fp32-to-bf16")
    print("fp32 -> bf16: moments", r["moment_err"], "after 2 bf16 steps", r["err"], r["worst_param"])


def test_import_plain_state_dict(runs):
    assert _result(runs, "import-tensor2@2")["err"] == 0.0


def _volume(sizes) -> int:
    v = 1
    for s in sizes:
        v *= s
    return v


def test_every_tensor_written_exactly_once(runs):
    """Replicas (data axes, tied weights held by two pipeline ranks) write one copy: the saved
    chunks of every tensor are disjoint and cover it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    _, _, tmp = runs
    for pair, *_ in PAIRS:
        md = dcp.FileSystemReader(str(tmp / pair)).read_metadata().state_dict_metadata
        n_model = 0
        for fqn, m in md.items():
            if not isinstance(m, TensorStorageMetadata):
                continue
            n_model += fqn.startswith("model.")
            boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in m.chunks]
            assert sum(_volume(s) for _, s in boxes) == _volume(m.size), (pair, fqn, boxes)
            for i, (o1, s1) in enumerate(boxes):
                for o2, s2 in boxes[i + 1:]:
                    overlap = all(a < b + t and b < a + s for a, s, b, t in zip(o1, s1, o2, s2))
                    assert not overlap, (pair, fqn, o1, o2)
        assert "model.lm_head.weight" not in md or "model.transformer.wte.weight" not in md
        if pair.startswith("tensor2-strided"):     # 3 blocks (q, k, v rows) from each of 2 ranks
            assert len(md["model.transformer.h.0.attn.c_attn.weight"].chunks) == 6


def _cli(*args):
    """``autopar <args>`` in this process (click's CliRunner, as tests/test_cli.py runs the
    commands that need no process of their own: a fresh interpreter costs seconds of imports)."""
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def test_cli_export_and_import(runs, tmp_path):
    _, _, tmp = runs
    src = tmp / PAIRS[0][0]
    if not (src / ".metadata").exists():
        pytest.skip("the save case did not run")
    out = tmp_path / "model.pt"
    r = _cli("checkpoint", "export", src, "-o", out)
    assert r.exit_code == 0, r.output
    sys.path.insert(0, ROOT)
    from examples.models import EXAMPLES
    model = EXAMPLES["gpt"](batch=8, seed=3).model
    model.load_state_dict(torch.load(out, weights_only=True))
    ref = export_checkpoint(src, tmp_path / "direct.pt")
    assert all(torch.equal(model.state_dict()[k], ref[k]) for k in model.state_dict())
    back = tmp_path / "back"
    r = _cli("checkpoint", "import", out, "-o", back)
    assert r.exit_code == 0, r.output
    again = export_checkpoint(back, tmp_path / "again.pt")
    assert set(again) == set(ref) and all(torch.equal(again[k], ref[k]) for k in ref)


def test_bad_paths(tmp_path):
    with pytest.raises(TypeError, match="ParallelModule"):
        load_checkpoint(tmp_path / "nowhere", pm=None)
    with pytest.raises(CheckpointError, match="does not exist"):
        import_state_dict(tmp_path / "missing.pt", tmp_path / "out")
    r = _cli("checkpoint", "export", tmp_path / "nowhere", "-o", tmp_path / "m.pt")
    assert r.exit_code == 2 and "not a checkpoint directory" in r.output, (r.exit_code, r.output)


def test_blocks_of_a_strided_shard():
    """S(0/3) on 2 ranks of a (12, 2) tensor: rank 1 holds rows 2-3, 6-7, 10-11."""
    got = blocks((12, 2), (Shard(0, 3),), (1,), (2,))
    assert got == [((2, 0), (0, 0), (2, 2)), ((6, 0), (2, 0), (2, 2)), ((10, 0), (4, 0), (2, 2))]
