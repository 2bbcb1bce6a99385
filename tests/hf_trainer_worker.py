"""Run by tests/test_hf_trainer.py under torchrun: an ordinary Hugging Face ``Trainer``
script (a tiny Llama built from a config, token data made here, AdamW, 20 steps, clipping
at max_grad_norm=0.5, an evaluation and a checkpoint every 10 steps) with the one added line,
``AutoparTrainer`` for ``Trainer``. The test runs the same script with the plain ``Trainer``
on one device (:func:`train` with ``trainer_cls=None``) and compares.

A case: ``pins`` for ``autopar.parallelize``; ``out``: the folder of its checkpoints and
saved model; ``resume``: train again from ``<out>/checkpoint-10`` of the case named, to
step 20, saving under ``out``; ``accumulate``: gradient_accumulation_steps (the step's rows in that many
micro-batches, all but the last backward under ``pm.no_sync()``); ``refused``: building the trainer must raise an
``autopar.ArgumentError`` holding that text.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

STEPS, SAVE_AT = 20, 10
ROWS = 4                  # the global batch: per_device_train_batch_size x world size
SEQ, VOCAB = 16, 64


def tiny_llama():
    """A 2-layer Llama from a config (no download), the same weights in every process."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="eager")


class Tokens(torch.utils.data.Dataset):
    """``STEPS x ROWS`` samples of random token ids; the labels are the ids (causal LM)."""

    def __init__(self, n: int = STEPS * ROWS, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(out: str, world: int, trainer_cls=None, pins: dict | None = None,
          resume: str | None = None, accumulate: int = 1):
    """The script: returns the trainer after ``train()`` and ``save_model(<out>/final)``.
    ``accumulate``: each step's ROWS in that many micro-batches."""
    from transformers import Trainer, TrainingArguments
    if trainer_cls is not None:      # the one added line: from ... import AutoparTrainer as Trainer
        Trainer = trainer_cls        # noqa: N806
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=ROWS // world // accumulate,
                             gradient_accumulation_steps=accumulate,
                             per_device_eval_batch_size=ROWS // world // accumulate,
                             eval_strategy="steps", eval_steps=SAVE_AT,
                             max_steps=STEPS, learning_rate=1e-2, weight_decay=0.1,
                             lr_scheduler_type="linear", warmup_steps=2, logging_steps=1,
                             save_strategy="steps", save_steps=SAVE_AT, report_to="none",
                             seed=0, use_cpu=True, disable_tqdm=True, max_grad_norm=0.5)
    extra = {} if trainer_cls is None else {"autopar": pins or {}}
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(),
                      eval_dataset=Tokens(4 * ROWS, seed=2), **extra)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(out, "final"))
    return trainer


def history(trainer, after: int = 0) -> dict:
    """Per step after ``after`` (a resumed run's state holds the checkpoint's log too): the
    logged loss and gradient norm."""
    logs = [h for h in trainer.state.log_history if "loss" in h and h["step"] > after]
    evals = [h for h in trainer.state.log_history if "eval_loss" in h and h["step"] > after]
    return {"step": [h["step"] for h in logs], "loss": [h["loss"] for h in logs],
            "grad_norm": [h["grad_norm"] for h in logs],
            "eval_step": [h["step"] for h in evals], "eval_loss": [h["eval_loss"] for h in evals]}


def run_case(case: dict) -> dict:
    import torch.distributed as dist
    import autopar
    from autopar.integrations.transformers import AutoparTrainer
    world = dist.get_world_size()
    if "refused" in case:
        try:
            train(case["out"], world, AutoparTrainer, case.get("pins"))
        except autopar.ArgumentError as e:
            assert case["refused"] in str(e), f"the error does not say {case['refused']!r}: {e}"
            return {"error": str(e)}
        raise AssertionError(f"AutoparTrainer trained under {case['pins']}, which it must refuse")
    resume = None
    if case.get("resume"):
        resume = os.path.join(case["resume"], f"checkpoint-{SAVE_AT}")
    trainer = train(case["out"], world, AutoparTrainer, case.get("pins"), resume,
                    case.get("accumulate", 1))
    pm = trainer.pm
    return {**history(trainer, SAVE_AT if resume else 0), "mesh": list(pm.plan.mesh_shape), "axes": list(pm.plan.mesh_axes),
            "local_param_numel": sum(p.numel() for p in pm.parameters()),
            "model_param_numel": sum(p.numel() for p in trainer.model.parameters())}


if __name__ == "__main__":
    from worker_loop import run_cases
    run_cases(run_case)
