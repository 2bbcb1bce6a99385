"""Pretrained weights without a full copy per rank (``autopar.runtime.weights``).

One torchrun launch of 2 gloo ranks (``tests/pretrained_worker.py``) runs a case per kind
of weights source, each a model built on the meta device under a sharded plan (tensor=2 or
ZeRO-3): its local shards equal, bitwise, those of the same plan built from the
materialised model, and 2 AdamW steps equal one device's, parameter by parameter:

- ``torch``: a ``torch.save`` file (memory-mapped), GPT (tied embedding / head, fused
  q/k/v) under tensor=2; the module as loaded is saved with ``autopar.save_checkpoint`` ...
- ``dcp``: ... and that checkpoint is the weights of GPT under data=2, ZeRO-3 (DCP reshards);
- ``safetensors``: a directory of two ``.safetensors`` files, Llama under ZeRO-3, built
  under ``autopar.meta_parameters()`` (its rotary tables, non-persistent buffers, computed
  by its own init);
- ``dcp-plain``: ``dcp.save(state_dict)`` without autopar's layout, Llama under tensor=2
  built under ``torch.device("meta")``, the rotary tables read from the checkpoint.

In one process: the kind of a path and the errors for bad paths; the meta model's capture
is the CPU model's (same fingerprint, so plan files made from a real model apply); missing,
unexpected and misshapen tensors and a buffer nobody computes are errors naming them.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import autopar
from autopar.capture import capture, fingerprint
from autopar.ops.comm import ThreadWorld
from autopar.runtime.weights import WeightsError, capture_view, weights_kind
from launch import torchrun_cases

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from examples.models import EXAMPLES  # noqa: E402


def _model(name: str, build=None):
    with build if build is not None else torch.device("cpu"):
        return EXAMPLES[name](batch=8, seed=0)


def _write_sources(tmp) -> dict[str, str]:
    """The seed-0 example models' weights in every kind of source."""
    from safetensors.torch import save_file
    gpt = _model("gpt").model.state_dict()
    llama_model = _model("llama").model
    llama = llama_model.state_dict()
    torch.save(gpt, tmp / "gpt.pt")
    st = tmp / "llama-st"
    st.mkdir()
    names = sorted(llama)
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        save_file({k: llama[k].contiguous() for k in part}, str(st / f"model-0000{i + 1}-of-00002.safetensors"))
    # a plain DCP state dict, the non-persistent rotary tables included
    dcp.save(dict(llama_model.named_buffers()) | llama, storage_writer=dcp.FileSystemWriter(str(tmp / "llama-dcp")),
             no_dist=True)
    return {"gpt.pt": str(tmp / "gpt.pt"), "llama-st": str(st), "llama-dcp": str(tmp / "llama-dcp"),
            "gpt-ckpt": str(tmp / "gpt-ckpt")}


def _cases(src: dict[str, str]) -> list[dict]:
    return [
        {"id": "torch-gpt-tensor2", "model": "gpt", "build": "meta", "source": src["gpt.pt"],
         "pins": {"tensor": 2}, "save": src["gpt-ckpt"]},
        {"id": "dcp-gpt-zero3", "model": "gpt", "build": "meta", "source": src["gpt-ckpt"],
         "pins": {"data": 2, "zero": 3}},
        {"id": "safetensors-llama-zero3", "model": "llama", "build": "meta_parameters",
         "source": src["llama-st"], "pins": {"data": 2, "zero": 3}},
        {"id": "dcp-plain-llama-tensor2", "model": "llama", "build": "meta", "source": src["llama-dcp"],
         "pins": {"tensor": 2}},
    ]


CASE_IDS = ["torch-gpt-tensor2", "dcp-gpt-zero3", "safetensors-llama-zero3", "dcp-plain-llama-tensor2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pretrained")
    return torchrun_cases("pretrained_worker.py", 2, _cases(_write_sources(tmp)), tmp / "pretrained.json",
                          timeout=600, case_timeout=150)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_meta_model_with_weights_equals_the_materialised_one(results, case_id):
    got, failed = results
    r = got.get(case_id)
    assert r is not None, f"{case_id}: no result, the launch ended before it\n{failed}"
    assert r["ok"], f"{case_id}: {r['error']}\n{r.get('trace', '')}"
    assert r["local_bytes"] < r["full_bytes"]


# ---- one process ---------------------------------------------------------------------------
def test_kind_of_a_path(tmp_path):
    (tmp_path / "m.pt").write_bytes(b"")
    (tmp_path / "m.safetensors").write_bytes(b"")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".metadata").write_bytes(b"")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    assert [weights_kind(tmp_path / p) for p in ("m.pt", "m.safetensors", "ckpt", "hf")] == \
        ["torch", "safetensors", "dcp", "safetensors"]
    (tmp_path / "empty").mkdir()
    (tmp_path / "m.npz").write_bytes(b"")
    for bad in ("missing.pt", "empty", "m.npz"):
        with pytest.raises(WeightsError) as e:
            weights_kind(tmp_path / bad)
        assert bad in str(e.value) and ".safetensors" in str(e.value) and "dcp.save" in str(e.value)


def test_meta_model_captures_as_the_cpu_model():
    """On the meta device GPT's graph differs (SDPA's meta strides add a copy); seen as CPU
    FakeTensors it is the real model's graph, so a plan made from the real model fits."""
    real = _model("gpt")
    meta = _model("gpt", torch.device("meta"))
    with capture_view(meta.model, real.inputs, real.target) as (inputs, target):
        cap = capture(meta.model, inputs, real.loss_fn, target)
    assert fingerprint(cap) == fingerprint(capture(real.model, real.inputs, real.loss_fn, real.target))
    assert all(p.is_meta for p in meta.model.parameters())       # put back after the capture


def _parallelize_one_rank(ex, weights):
    """``parallelize`` on one simulated rank; its error as it was raised."""
    try:
        return ThreadWorld((1,)).run(lambda comm: autopar.parallelize(
            ex.model, ex.inputs, ex.loss_fn, target=ex.target, comm=comm, weights=weights))[0]
    except RuntimeError as e:
        raise e.__cause__ or e


def test_bad_weights_name_what_is_wrong(tmp_path):
    """Every problem at once, each named: a parameter missing, a tensor the model does not
    have, a shape that differs, and Llama's rotary tables (non-persistent buffers, not in
    its state dict) that nobody computes on the meta device."""
    real = _model("llama")
    sd = dict(real.model.state_dict())
    del sd["layers.0.attention_norm.weight"]
    sd["layers.0.feed_forward.extra"] = torch.zeros(3)
    sd["norm.weight"] = torch.zeros(5)
    torch.save(sd, tmp_path / "bad.pt")
    meta = _model("llama", torch.device("meta"))
    meta.inputs, meta.target = real.inputs, real.target
    with pytest.raises(WeightsError) as e:
        _parallelize_one_rank(meta, str(tmp_path / "bad.pt"))
    msg = str(e.value)
    for part in ("bad.pt", "lacks 1 parameters", "layers.0.attention_norm.weight",
                 "layers.0.feed_forward.extra", "norm.weight: (5,) in the weights, (32,) in the model",
                 "rope_cos", "rope_sin", "autopar.meta_parameters()"):
        assert part in msg, msg
