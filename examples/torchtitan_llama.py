"""torchtitan's own trainer, data loader and Llama 3, with autopar as its parallelize function.

    python examples/torchtitan_llama.py                  # the three runs below, side by side

runs, each under ``torchrun`` on CPU (gloo) ranks, a few steps of a tiny torchtitan Llama 3
from one seed on one data set, and prints the losses step by step:

- ``autopar``: 2 ranks, ``parallelize_fn`` = ``autopar.integrations.torchtitan`` (the plan:
  ``--pins``, by default ``data=2``; ``--pins free`` lets the solver choose);
- ``fsdp``: 2 ranks, torchtitan's own ``parallelize_llama`` (FSDP2, fp32);
- ``one``: 1 rank, the whole global batch, no parallelism at all.

``--accumulate N`` makes each step N micro-batches (torchtitan's ``global_batch_size``);
``--max-norm`` is the clip (0.5 by default: below these steps' gradient norms, so it acts).
Every job steps AdamW ``foreach`` rather than torchtitan's default fused kernel (see
``trainer_config``). One run alone: ``torchrun --nproc-per-node 2 examples/torchtitan_llama.py --job autopar
--out losses.json``. Needs ``pip install torchtitan==0.3.0`` (its trainer's dependencies,
``triton`` among them for its imports); ``tests/test_titan_trainer.py`` runs it.

The model is torchtitan's ``Llama3Model`` (2 layers, width 64, causal scaled-dot-product
attention: autopar does not capture flex attention). The data is torchtitan's text loader
(``c4_test``'s loader on a local folder this script writes: documents of ``seq_len + 1``
tokens, one row each) with a word-level tokenizer this script writes too (no download). Rank
``r`` of 2 reads the ``r``-th half of the documents; the one-device run reads a copy whose
order puts, for each step, rank 0's rows and then rank 1's: the same global batches.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SEQ, ROWS_PER_RANK, RANKS, STEPS = 32, 2, 2, 4
WORDS = [f"w{i}" for i in range(96)]
VOCAB = 128                     # >= the tokenizer's 99 ids (words, [UNK], <s>, </s>)


# ---- data and tokenizer (files torchtitan's own loaders read) --------------------------------
def write_assets(root: str, docs: int = 64, seed: int = 0) -> dict:
    """A tokenizer folder and two copies of one text data set (2-rank and one-device order)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok_dir = os.path.join(root, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
    rng = random.Random(seed)
    # a document of SEQ - 1 words is <s> + words + </s>: SEQ + 1 tokens, exactly one row
    texts = [" ".join(rng.choice(WORDS) for _ in range(SEQ - 1)) for _ in range(docs)]
    half = docs // 2
    one = []                    # one device's order: each step's rank-0 rows, then rank 1's
    for k in range(0, half, ROWS_PER_RANK):
        one += texts[k:k + ROWS_PER_RANK] + texts[half + k:half + k + ROWS_PER_RANK]
    paths = {}
    for name, order in (("ranks", texts), ("one", one)):
        d = os.path.join(root, f"data_{name}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "train.json"), "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in order)
        paths[name] = d
    return {"tokenizer": tok_dir, **paths}


# ---- the model and the trainer's config ------------------------------------------------------
def llama3_config(seq: int, dim: int, layers: int, heads: int, vocab: int):
    """torchtitan 0.3's ``Llama3Model.Config`` at these sizes (its debug model's config,
    ``torchtitan/models/llama3/__init__.py``: ``_debugmodel``, smaller), causal
    scaled-dot-product attention (``tests/titan_llama.py`` builds it too)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    import torchtitan.models.llama3 as t
    cfg = t.Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=t.Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                          param_init=t._EMBEDDING_INIT),
        norm=t.RMSNorm.Config(normalized_shape=dim, param_init=t._NORM_INIT),
        lm_head=t.Linear.Config(in_features=dim, out_features=vocab,
                                param_init=t._output_linear_init(dim)),
        layers=t._build_llama3_layers(
            fuse_qkv=True, n_layers=layers, dim=dim, n_heads=heads,
            hidden_dim=t.compute_ffn_hidden_dim(dim, multiple_of=32),
            rope=t.ComplexRoPE.Config(dim=dim // heads, max_seq_len=seq, theta=500000,
                                      scaling="llama"),
            attn_backend="flex"))
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def tiny_llama3_spec():
    """torchtitan's Llama 3 ModelSpec (``model_registry``'s), 2 layers of width 64, causal
    scaled-dot-product attention."""
    from torchtitan.models.llama3 import model_registry
    cfg = llama3_config(SEQ, 64, 2, 4, VOCAB)
    spec = model_registry("debugmodel")
    spec.model, spec.flavor = cfg, "tiny"
    return spec


def fsdp_on_gloo(parallelize_llama):
    """torchtitan's ``parallelize_llama`` as it is; then every FSDP2 module reduces with plain
    sums (``set_force_sum_reduction_for_comms``): torchtitan sets the gradient divide factor
    to 1, which FSDP2 runs as ``ReduceOp.PREMUL_SUM``, and gloo has no ``PREMUL_SUM``."""
    from torch.distributed.fsdp import FSDPModule

    def parallelize(model, **kwargs):
        model = parallelize_llama(model, **kwargs)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize


def trainer_config(run: str, assets: dict, pins: dict, dump: str, accumulate: int = 1,
                   max_norm: float = 0.5):
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.config.configs import DebugConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.trainer import Trainer

    from autopar.integrations import torchtitan as titan

    spec = tiny_llama3_spec()
    if run == "autopar":
        spec = titan.model_spec(spec, **pins)
    elif run == "fsdp":         # torchtitan's parallelize_llama, its reductions as gloo has them
        spec.parallelize_fn = fsdp_on_gloo(spec.parallelize_fn)
    elif run == "one":          # one device: the model as it is built, nothing applied
        spec.parallelize_fn, spec.pipelining_fn = (lambda model, **_: model), None
    world = RANKS if run != "one" else 1
    return Trainer.Config(
        model_spec=spec, hf_assets_path=assets["tokenizer"], dump_folder=dump,
        loss=CrossEntropyLoss.Config(global_vocab_size=VOCAB),
        # foreach, not torchtitan's default fused AdamW: torch 2.13's fused CPU kernel updates a
        # non-contiguous parameter wrongly, and ZeRO-1/2's shards split on a dim > 0 are such
        # views (autopar refuses it there); every job steps the same AdamW
        optimizer=dataclasses.replace(default_adamw(lr=8e-3), implementation="foreach"),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8,
                                                  decay_type="linear", min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=ROWS_PER_RANK * RANKS // world, seq_len=SEQ,
                                global_batch_size=ROWS_PER_RANK * RANKS * accumulate,
                                steps=STEPS, max_norm=max_norm, disable_cuda_graphs=True,
                                mixed_precision_param="float32"),
        dataloader=HuggingFaceTextDataLoader.Config(
            dataset="c4_test", dataset_path=assets["one" if run == "one" else "ranks"]),
        # FSDP2 on the data-parallel mesh, DTensors only for model-parallel axes (none here)
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        metrics=MetricsProcessor.Config(log_freq=1),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
        validator=Validator.Config(enable=False),
        debug=DebugConfig(seed=0))


def train(run: str, assets: dict, pins: dict, out: str | None, accumulate: int = 1,
          max_norm: float = 0.5) -> list:
    """One run inside torchrun: torchtitan's Trainer; returns [(loss, grad_norm)] per step."""
    import torch.distributed as dist
    from autopar.integrations import torchtitan as titan

    titan.use_cpu()             # no-op where torchtitan found an accelerator
    with tempfile.TemporaryDirectory() as dump:
        trainer = trainer_config(run, assets, pins, dump, accumulate, max_norm).build()
        steps = []
        log = trainer.metrics_processor.log

        def record(step, loss, max_loss, grad_norm, *a, **k):
            steps.append((float(loss), float(grad_norm)))
            return log(step, loss, max_loss, grad_norm, *a, **k)

        trainer.metrics_processor.log = record
        try:
            trainer.train()
        finally:
            trainer.close()
    if out and dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(steps, f)
    dist.destroy_process_group()
    return steps


def launch(run: str, assets: str, pins: str, out: str, accumulate: int = 1,
           max_norm: float = 0.5) -> None:
    """``torchrun`` the ``run`` on its ranks (2, or 1 for ``one``)."""
    n = 1 if run == "one" else RANKS
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
           os.path.abspath(__file__), "--job", run, "--assets", assets, "--pins", pins,
           "--accumulate", str(accumulate), "--max-norm", str(max_norm),
           "--out", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if run != "autopar" else None)


def parse_pins(text: str) -> dict:
    if text == "free":
        return {}
    out = {}
    for part in filter(None, text.split(",")):
        k, v = part.split("=")
        out[k] = int(v) if v.isdigit() else v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", choices=("autopar", "fsdp", "one"), help="one run (under torchrun)")
    ap.add_argument("--jobs", default="autopar,fsdp,one", help="without --job: which to launch")
    ap.add_argument("--pins", default="data=2", help="autopar pins, e.g. data=2 or zero=3,data=2; "
                    "'free': the solver chooses")
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches a step "
                    "(torchtitan's global_batch_size over local_batch_size x data ranks)")
    ap.add_argument("--max-norm", type=float, default=0.5, help="torchtitan's gradient clip "
                    "(training.max_norm); 0.5 is below these steps' norms: the clip acts")
    ap.add_argument("--assets", help="the tokenizer and data folder (written when missing)")
    ap.add_argument("--out", help="with --job: write the per-step [loss, grad_norm] here (rank 0)")
    ap.add_argument("--results", help="without --job: write {job: [[loss, grad_norm], ...]} here")
    args = ap.parse_args()
    if args.job:
        with open(os.path.join(args.assets, "assets.json")) as f:
            assets = json.load(f)
        train(args.job, assets, parse_pins(args.pins), args.out, args.accumulate, args.max_norm)
        return
    with tempfile.TemporaryDirectory() as root:
        with open(os.path.join(root, "assets.json"), "w") as f:
            json.dump(write_assets(root), f)
        results = {}
        for run in args.jobs.split(","):
            out = os.path.join(root, f"{run}.json")
            launch(run, root, args.pins, out, args.accumulate, args.max_norm)
            with open(out) as f:
                results[run] = json.load(f)
    if args.results:
        with open(args.results, "w") as f:
            json.dump(results, f)
    runs = list(results)
    print("step  " + "  ".join(f"{r + ' loss':>14} {r + ' |g|':>12}" for r in runs))
    for i in range(STEPS):
        print(f"{i + 1:>4}  " + "  ".join(f"{results[r][i][0]:>14.6f} {results[r][i][1]:>12.6f}"
                                          for r in runs))


if __name__ == "__main__":
    main()
