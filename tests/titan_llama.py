"""torchtitan's own Llama 3 and Qwen3 (torchtitan 0.3's ``Llama3Model`` and ``Qwen3Model``,
dense), tiny, built on the CPU: model code written outside autopar, as a torchtitan user
brings it.

Each model is built from its config as torchtitan's model registry builds it: the debug
model's (``torchtitan/models/llama3/__init__.py`` and ``models/qwen3/__init__.py``:
``_debugmodel``) at smaller sizes, with torchtitan's ``ScaledDotProductAttention`` (causal)
as every layer's inner attention: 0.3's language models default to flex attention, which
autopar does not capture (a ``CaptureError`` names it). The model code itself runs
unchanged. Qwen3 keeps what its debug model has and Llama 3 has not: grouped-query
attention (2 key/value heads for 4 query heads), RMSNorm of each head's queries and keys
(qk-norm), cos/sin (real) rotary embeddings rather than complex ones, and the output
projection tied to the token embedding (one parameter, initialized as the projection).

What it needs installed: ``torchtitan==0.3.0`` with its dependencies (the Makefile's and
pyproject's ``titan`` extra) and ``triton``, which 0.3's model modules import
(``models/common/token_dispatcher.py`` -> ``distributed/minimal_async_ep/kernels.py``) and
torchtitan does not declare. (0.2.0's model, ``models/llama3/model/model.py``, is gone in
0.3: one version is installed, the one ``autopar.integrations.torchtitan`` is for.)
"""
from __future__ import annotations

import importlib.metadata
import importlib.util

TITAN_VERSION = "0.3.0"
# what importing torchtitan 0.3's Llama 3 model imports beyond torch
MODEL_IMPORTS = ("triton", "tyro", "tokenizers", "einops", "spmd_types", "torchdata",
                 "torch_checkpointing", "datasets")


def missing() -> str | None:
    """Why torchtitan's Llama 3 and Qwen3 cannot be built here, or None."""
    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return f"torchtitan is not installed (pip install torchtitan=={TITAN_VERSION} triton)"
    if not version.startswith("0.3"):
        return (f"torchtitan {version} is installed; the test is written for "
                f"torchtitan=={TITAN_VERSION}'s Llama3Model and Qwen3Model")
    for dep in MODEL_IMPORTS:
        if importlib.util.find_spec(dep) is None:
            return f"torchtitan {version}'s model code imports {dep}, which is not installed"
    return None


def llama3(seq: int, dim: int, layers: int, heads: int, vocab: int):
    """torchtitan 0.3's ``Llama3Model`` at these sizes, causal scaled-dot-product attention;
    built on the CPU, not yet initialized (``init_weights``)."""
    from examples.torchtitan_llama import llama3_config
    cfg = llama3_config(seq, dim, layers, heads, vocab)
    return cfg.build()


def qwen3(seq: int, dim: int, layers: int, heads: int, vocab: int, kv_heads: int = 2,
          hidden: int = 192):
    """torchtitan 0.3's dense ``Qwen3Model`` at these sizes (its ``_debugmodel``'s config:
    fused qkv, qk-norm, cos/sin rotary embeddings at theta 1e6, tied embedding; head size
    ``dim // heads``), causal scaled-dot-product attention; built on the CPU, not yet
    initialized."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    import torchtitan.models.qwen3 as q
    head_dim = dim // heads
    cfg = q.Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=q._qwen3_norm(dim), enable_weight_tying=True,
        tok_embeddings=q.Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                          param_init=q._EMBEDDING_SKIP_INIT),
        lm_head=q.Linear.Config(in_features=dim, out_features=vocab, param_init=q._LINEAR_INIT),
        layers=q._build_qwen3_layers(
            fuse_qkv=True, n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=kv_heads,
            head_dim=head_dim, hidden_dim=hidden, attn_backend="flex",
            rope=q.CosSinRoPE.Config(dim=head_dim, max_seq_len=seq, theta=1000000.0)))
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg.build()


MODELS = {"llama3": llama3, "qwen3": qwen3}


def build(seed: int = 0, batch: int = 4, seq: int = 32, dim: int = 64, layers: int = 1,
          heads: int = 4, vocab: int = 256, model: str = "llama3"):
    """(model, inputs, target, loss_fn): torchtitan's Llama 3 or Qwen3 (``model``: a key of
    MODELS) at dim 64, 1 layer, 4 heads, vocabulary 256, sequence 32, its own
    ``init_weights``; next-token cross-entropy."""
    import torch
    why = missing()
    if why:
        raise ImportError(why)
    if model not in MODELS:
        raise ValueError(f"unknown torchtitan model {model!r}: one of {sorted(MODELS)}")
    torch.manual_seed(seed)
    model = MODELS[model](seq, dim, layers, heads, vocab)
    model.init_weights()
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1))
    return model, (tokens[:, :-1],), tokens[:, 1:], loss_fn
