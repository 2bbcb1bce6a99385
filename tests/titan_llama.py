"""torchtitan's own Llama 3 (torchtitan 0.3's ``Llama3Model``), tiny, built on the CPU: model
code written outside autopar, as a torchtitan user brings it.

The model is built from its config as torchtitan's model registry builds it: the debug
model's (``torchtitan/models/llama3/__init__.py``: ``_debugmodel``) at smaller sizes, with
torchtitan's ``ScaledDotProductAttention`` (causal) as every layer's inner attention: 0.3's
language models default to flex attention, which autopar does not capture (a
``CaptureError`` names it). The model code itself runs unchanged.

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
    """Why torchtitan's Llama 3 cannot be built here, or None."""
    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return f"torchtitan is not installed (pip install torchtitan=={TITAN_VERSION} triton)"
    if not version.startswith("0.3"):
        return (f"torchtitan {version} is installed; the test is written for "
                f"torchtitan=={TITAN_VERSION}'s Llama3Model")
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


def build(seed: int = 0, batch: int = 4, seq: int = 32, dim: int = 64, layers: int = 1,
          heads: int = 4, vocab: int = 256):
    """(model, inputs, target, loss_fn): torchtitan's Llama 3 at dim 64, 1 layer, 4 heads,
    vocabulary 256, sequence 32, its own ``init_weights``; next-token cross-entropy."""
    import torch
    why = missing()
    if why:
        raise ImportError(why)
    torch.manual_seed(seed)
    model = llama3(seq, dim, layers, heads, vocab)
    model.init_weights()
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1))
    return model, (tokens[:, :-1],), tokens[:, 1:], loss_fn
