"""torchtitan's own Llama 3 (``torchtitan.models.llama3``'s ``Transformer``), tiny, built on
the CPU: model code written outside autopar, as a torchtitan user brings it.

torchtitan 0.2.0's package ``__init__`` imports its whole trainer (its MoE kernels import
``triton``; its data loaders ``torchdata`` and ``datasets``; its metrics ``tensorboard``),
none of which the model needs and ``triton`` has no CPU build torch's CPU wheel pulls.
:func:`load` therefore imports the model's two files (``model/model.py``, ``model/args.py``)
from the installed package without running the package ``__init__`` files on the way, and
names ``torchtitan.protocols.train_spec`` by the one name the model reads from it
(``ModelProtocol``, defined in ``torchtitan.protocols.model``). The model code itself runs
unchanged. What it needs installed: ``torchtitan==0.2.0`` (``--no-deps``), ``tyro`` (its
config module) and ``tokenizers``.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import types

TITAN_VERSION = "0.2.0"


_ROOT: list[str] = []


def _root() -> str | None:
    """The installed torchtitan package's folder (found before :func:`load` names it)."""
    if not _ROOT:
        spec = importlib.util.find_spec("torchtitan")
        if spec is None or spec.origin is None:
            return None
        _ROOT.append(os.path.dirname(spec.origin))
    return _ROOT[0]


def missing() -> str | None:
    """Why torchtitan's Llama 3 cannot be loaded here, or None."""
    root = _root()
    if root is None:
        return f"torchtitan is not installed (pip install --no-deps torchtitan=={TITAN_VERSION} tyro)"
    for dep in ("tyro", "tokenizers"):
        if importlib.util.find_spec(dep) is None:
            return f"torchtitan's model code imports {dep}, which is not installed"
    if not os.path.exists(os.path.join(root, "models", "llama3", "model", "model.py")):
        return (f"this torchtitan ({root}) has no models/llama3/model/model.py: the test is "
                f"written for torchtitan=={TITAN_VERSION}'s Transformer")
    return None


def load():
    """(Transformer, TransformerModelArgs) from the installed torchtitan."""
    why = missing()
    if why:
        raise ImportError(why)
    root = _root()
    for name, sub in (("torchtitan", ""), ("torchtitan.models", "models"),
                      ("torchtitan.models.llama3", "models/llama3"),
                      ("torchtitan.protocols", "protocols")):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [os.path.join(root, sub)]
            sys.modules[name] = pkg
    if "torchtitan.protocols.train_spec" not in sys.modules:
        from torchtitan.protocols.model import ModelProtocol
        spec_mod = types.ModuleType("torchtitan.protocols.train_spec")
        spec_mod.ModelProtocol = ModelProtocol
        sys.modules[spec_mod.__name__] = spec_mod
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer
    return Transformer, TransformerModelArgs


def build(seed: int = 0, batch: int = 4, seq: int = 32, dim: int = 64, layers: int = 1,
          heads: int = 4, vocab: int = 256):
    """(model, inputs, target, loss_fn): torchtitan's Llama 3 at dim 64, 1 layer, 4 heads,
    vocabulary 256, sequence 32, its own ``init_weights``; next-token cross-entropy."""
    import torch
    Transformer, Args = load()
    torch.manual_seed(seed)
    model = Transformer(Args(dim=dim, n_layers=layers, n_heads=heads, vocab_size=vocab,
                             max_seq_len=seq))
    model.init_weights()
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)

    def loss_fn(logits, target):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1))
    return model, (tokens[:, :-1],), tokens[:, 1:], loss_fn
