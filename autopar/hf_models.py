"""Models planned by name: ``hf:NAME`` (a config shipped in ``autopar/hf_configs``) or
``hf:PATH/config.json`` (any transformers config file) as (model, inputs, loss_fn, target).

The model is transformers' own class for the config's ``architectures`` (``AutoConfig.for_model``,
then that class), built in fp32 (``--pin precision=bf16`` plans mixed precision) with SDPA
attention and no KV cache; under ``torch.device("meta")`` it takes no memory. The training
step it is planned for follows the head:

- ``...ForCausalLM`` / ``...LMHeadModel``: (batch, seq) token ids, cross-entropy of the logits
  against (batch, seq) targets;
- ``...ForMaskedLM``: the same over the masked-LM head;
- ``...ForImageClassification``: (batch, channels, image_size, image_size) images,
  cross-entropy against (batch,) class ids (``seq`` does not apply).

    model, inputs, loss_fn, target = build("llama3-70b", batch=16, seq=8192)
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from autopar.errors import AutoparInputError

__all__ = ["HFConfigError", "SHIPPED_DIR", "shipped", "load_config", "build"]

SHIPPED_DIR = Path(__file__).parent / "hf_configs"
"""The published configs shipped as data: ``NAME.json``, each with a ``_source`` key."""


class HFConfigError(AutoparInputError):
    """An ``hf:`` model that cannot be built: an unknown name, a missing or unreadable
    config file, an architecture autopar has no training step for, a batch or sequence
    length that does not fit it."""


def shipped() -> list[str]:
    """The names ``hf:NAME`` accepts, sorted."""
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.json"))


def _names() -> str:
    return ", ".join(shipped())


def load_config(spec: str) -> tuple[str, dict]:
    """``NAME`` or ``PATH`` (a file, or a folder holding ``config.json``) -> (its name, the
    config dict without the keys that start with ``_``)."""
    looks_like_path = spec.endswith(".json") or "/" in spec or "\\" in spec
    if not looks_like_path:
        path = SHIPPED_DIR / f"{spec}.json"
        if not path.is_file():
            raise HFConfigError(f"hf:{spec} is not a shipped config; shipped: {_names()} "
                                "(or give a path: hf:PATH/config.json)")
    else:
        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise HFConfigError(f"hf:{spec}: no such file {str(path)!r}; give the path of a "
                                f"transformers config.json, or a shipped name: {_names()}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise HFConfigError(f"hf:{spec}: cannot read {path} ({e})") from e
    except json.JSONDecodeError as e:
        raise HFConfigError(f"hf:{spec}: {path} is not valid JSON ({e})") from e
    if not isinstance(raw, dict) or "model_type" not in raw or not raw.get("architectures"):
        raise HFConfigError(f"hf:{spec}: {path} is not a transformers config: it needs "
                            "\"model_type\" and \"architectures\" (as a model's config.json has)")
    name = path.stem if path.parent == SHIPPED_DIR else str(path)
    return name, {k: v for k, v in raw.items() if not k.startswith("_")}


_TASKS = (("ForCausalLM", "causal-lm"), ("LMHeadModel", "causal-lm"),
          ("ForMaskedLM", "masked-lm"), ("ForImageClassification", "image-classification"))


def _task(arch: str) -> str:
    for suffix, task in _TASKS:
        if arch.endswith(suffix):
            return task
    raise HFConfigError(f"architecture {arch}: autopar plans causal LMs (...ForCausalLM, "
                        "...LMHeadModel), masked LMs (...ForMaskedLM) and image classifiers "
                        "(...ForImageClassification); write a MODULE:FACTORY for other heads")


def lm_loss(out, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a language model's ``out.logits`` (B, T, V) against ``target`` (B, T)."""
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def classification_loss(out, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``out.logits`` (B, classes) against ``target`` (B,)."""
    return F.cross_entropy(out.logits, target)


def _positive(what: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise HFConfigError(f"{what} must be a positive integer, not {v!r}")
    return v


def _model(name: str, cfg: dict, layers: int | None):
    try:
        import transformers             # a dependency, imported late: only hf: models need it
        from transformers import AutoConfig
    except ImportError as e:
        raise HFConfigError(f"hf: models are built by transformers, which is not installed "
                            f"({e}): pip install transformers") from e

    arch = cfg["architectures"][0]
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise HFConfigError(f"{name}: transformers {transformers.__version__} has no class "
                            f"{arch}; upgrade transformers or fix \"architectures\"")
    kw = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(cfg["model_type"], **kw)
    except (ValueError, KeyError, TypeError) as e:
        raise HFConfigError(f"{name}: transformers cannot read this config ({e})") from e
    config.use_cache = False
    if layers is not None:
        config.num_hidden_layers = _positive("layers", layers)
    try:
        model = cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    except (ValueError, ImportError):          # no SDPA for this architecture: its default
        model = cls._from_config(config, dtype=torch.float32)
    return model, config


def build(spec: str, batch: int | None = None, seq: int | None = None,
          layers: int | None = None):
    """(model, inputs, loss_fn, target) for ``hf:SPEC``'s training step at ``batch`` x
    ``seq`` (``layers``: keep only the first N layers, for a quick look). Call it under
    ``torch.device("meta")`` for a model without memory."""
    name, cfg = load_config(spec)
    task = _task(cfg["architectures"][0])
    if batch is None:
        raise HFConfigError(f"hf:{spec} needs a batch size: --batch B")
    batch = _positive("batch", batch)
    model, config = _model(name, cfg, layers)
    dev = torch.get_default_device()
    if task == "image-classification":
        if seq is not None:
            raise HFConfigError(f"hf:{spec} classifies {config.image_size}x{config.image_size} "
                                "images: drop --seq (its sequence is the patches)")
        size, ch = config.image_size, config.num_channels
        images = torch.zeros(batch, ch, size, size, device=dev)
        labels = torch.zeros(batch, dtype=torch.long, device=dev)
        return model, (images,), classification_loss, labels
    if seq is None:
        raise HFConfigError(f"hf:{spec} needs a sequence length: --seq S")
    seq = _positive("seq", seq)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq > limit:
        raise HFConfigError(f"--seq {seq} is longer than {name}'s max_position_embeddings "
                            f"{limit}: use --seq {limit} or less")
    if dev.type == "meta":
        tokens = torch.zeros(batch, seq, dtype=torch.long, device=dev)
    else:                                       # real weights (verify): varied token ids
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(dev)
    return model, (tokens,), lm_loss, tokens
