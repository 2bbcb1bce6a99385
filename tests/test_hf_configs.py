"""Models planned by name (``hf:NAME``, ``hf:PATH/config.json``): every shipped config builds
on the meta device with its published parameter count; bad names, paths and flags are one
clear line (exit 2); ``autopar plan hf:...`` prints a plan."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("transformers")

from autopar import hf_models  # noqa: E402
from autopar.cli import cli  # noqa: E402
from autopar.hf_models import HFConfigError  # noqa: E402

# The published parameter counts (the independent fact each config is checked against):
# Hugging Face model cards / safetensors totals and the papers. Llama 3.1 8B 8.03B, 70B 70.6B,
# 405B 406B (Meta: 405B); Mixtral 8x7B 46.7B; Mixtral 8x22B 141B (Mistral AI's announcement:
# "141B parameters", 39B active); Qwen3-8B 8.2B; Qwen3-30B-A3B 30.5B;
# DeepSeek-V3 671B (the main model; 685B with its MTP module, which transformers does not
# build); DeepSeek-V2 236B (its paper's abstract); Qwen3-235B-A22B 235B (its model card);
# GPT-2 124M / 355M / 774M / 1558M; BERT base / large 110M / 340M; ViT-B/16 86M,
# ViT-L/16 307M (ViT paper, Table 1).
PUBLISHED = {
    "llama3-8b": 8.03e9, "llama3-70b": 70.6e9, "llama3-405b": 406e9,
    "mixtral-8x7b": 46.7e9, "mixtral-8x22b": 141e9, "qwen3-8b": 8.2e9, "qwen3-30b-a3b": 30.5e9, "deepseek-v3": 671e9,
    "deepseek-v2": 236e9, "qwen3-235b-a22b": 235e9,
    "gpt2": 124e6, "gpt2-medium": 355e6, "gpt2-large": 774e6, "gpt2-xl": 1558e6,
    "bert-base": 110e6, "bert-large": 340e6, "vit-b16": 86e6, "vit-l16": 307e6,
}
REL = 0.01          # a Llama 3 70B with 79 layers is 1.2% short
TOLERANCE = {"bert-large": 0.02}    # 340M is the paper's round figure for its 335M

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64}


def run(*args, code=0):
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert res.exit_code == code, f"exit {res.exit_code} != {code}\n{res.output}"
    assert "Traceback" not in res.output
    return res


def test_the_shipped_names_are_the_published_ones():
    assert hf_models.shipped() == sorted(PUBLISHED)
    for name in hf_models.shipped():
        raw = json.loads((hf_models.SHIPPED_DIR / f"{name}.json").read_text())
        assert raw["_source"].strip(), name            # where the numbers come from
        assert "_source" not in hf_models.load_config(name)[1]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_config_builds_on_meta_with_its_published_size(name):
    kw = {"batch": 2} if name.startswith("vit") else {"batch": 2, "seq": 16}
    with torch.device("meta"):
        model, inputs, loss_fn, target = hf_models.build(name, **kw)
    assert all(p.is_meta for p in model.parameters())
    n = sum(p.numel() for p in model.parameters())
    assert abs(n / PUBLISHED[name] - 1) <= TOLERANCE.get(name, REL), \
        f"{name}: {n:,} parameters, published {PUBLISHED[name]:,.0f}"
    assert inputs[0].shape[0] == 2 and target.shape[0] == 2


def test_a_vision_model_takes_images_and_class_ids():
    with torch.device("meta"):
        _, (x,), loss_fn, y = hf_models.build("vit-b16", batch=3)
    assert tuple(x.shape) == (3, 3, 224, 224) and tuple(y.shape) == (3,)
    assert loss_fn is hf_models.classification_loss


def test_layers_keeps_the_first_n():
    with torch.device("meta"):
        model, *_ = hf_models.build("llama3-70b", batch=1, seq=8, layers=2)
    assert len(model.model.layers) == 2


@pytest.mark.parametrize("spec, kw, words", [
    ("llama3-7b", {"batch": 1, "seq": 8}, ["not a shipped config", "llama3-8b", "vit-l16", "hf:PATH"]),
    ("no/such/config.json", {"batch": 1, "seq": 8}, ["no such file", "no/such/config.json"]),
    ("llama3-8b", {"seq": 8}, ["--batch"]),
    ("llama3-8b", {"batch": 1}, ["--seq"]),
    ("gpt2", {"batch": 1, "seq": 2048}, ["max_position_embeddings 1024", "--seq 1024"]),
    ("vit-b16", {"batch": 1, "seq": 16}, ["drop --seq", "224x224"]),
])
def test_bad_specs_and_flags_say_what_to_fix(spec, kw, words):
    with torch.device("meta"), pytest.raises(HFConfigError) as e:
        hf_models.build(spec, **kw)
    for w in words:
        assert w in str(e.value)


def test_bad_json_and_configs_that_are_not_transformers_ones(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(HFConfigError, match="not valid JSON"):
        hf_models.load_config(str(bad))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(HFConfigError, match="model_type"):
        hf_models.load_config(str(other))
    head = tmp_path / "head.json"
    head.write_text(json.dumps({**TINY, "architectures": ["LlamaForSequenceClassification"]}))
    with pytest.raises(HFConfigError, match="ForCausalLM"):
        hf_models.build(str(head), batch=1, seq=8)


def test_cli_bad_name_lists_the_shipped_ones():
    res = run("plan", "hf:llama-70b", "--batch", "1", "--seq", "8", code=2)
    assert "not a shipped config" in res.output
    assert all(n in res.output for n in PUBLISHED)
    res = run("plan", "hf:gpt2", "--batch", "1", "--seq", "8", "--factory-args", "batch=2", code=2)
    assert "--batch and --factory-args batch" in res.output


def test_cli_plans_a_shipped_model_by_name():
    res = run("plan", "hf:llama3-8b", "--layers", "1", "--batch", "2", "--seq", "16",
              "--cluster", "cpu:2")
    assert "autopar plan: mesh" in res.output
    assert "model.layers.0.mlp.gate_proj.weight" in res.output
    assert "[128256, 4096]" in res.output          # the published vocabulary and hidden size


def test_cli_plans_a_config_file_and_explains_its_plan(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"_source": "a test", **TINY}))
    out = tmp_path / "plan.json"
    res = run("plan", f"hf:{path}", "--batch", "4", "--seq", "16", "--cluster", "cpu:2",
              "--pin", "data=2", "-o", out)
    assert "model.layers.{0..1}.self_attn.q_proj.weight" in res.output and out.exists()
    res = run("explain", out, "model.layers.0.mlp.up_proj.weight", "--factory", f"hf:{tmp_path}",
              "--batch", "4", "--seq", "16")
    assert "chose" in res.output
