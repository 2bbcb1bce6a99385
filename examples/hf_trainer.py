"""An ordinary Hugging Face ``Trainer`` script, parallelized by autopar with one added line.

    torchrun --nproc-per-node 2 examples/hf_trainer.py
    torchrun --nproc-per-node 4 examples/hf_trainer.py --steps 40

A small Llama built from a config (no download) learns sequences that count up by a fixed
stride. Every rank reads ``--batch`` rows a step, as under DDP (the global batch is
``--batch`` x ranks); autopar's solver picks the plan for the job's ranks (pins:
``Trainer(..., autopar={"data": 2, "zero": 3})``). ``save_model`` writes a plain
Hugging Face model (``LlamaForCausalLM.from_pretrained(<out>/final)``); checkpoints go to
``<out>/checkpoint-N`` and resume with ``--resume``.

Without the marked line this is the plain Trainer (DDP under torchrun).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from autopar.integrations.transformers import AutoparTrainer as Trainer  # noqa: E402,F811  <- the added line

VOCAB, SEQ = 128, 32


class Counting(torch.utils.data.Dataset):
    """``n`` sequences ``start, start + stride, ...`` (mod VOCAB): a causal LM learns to
    continue them; the labels are the ids (the model shifts them)."""

    def __init__(self, n: int = 4096, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model() -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="eager")


def training_args(out: str, steps: int, batch: int) -> TrainingArguments:
    return TrainingArguments(output_dir=out, per_device_train_batch_size=batch, max_steps=steps,
                             learning_rate=3e-3, warmup_steps=max(1, steps // 10),
                             logging_steps=max(1, steps // 10), save_steps=max(1, steps // 2),
                             report_to="none", seed=0, use_cpu=not torch.cuda.is_available())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="rows per rank per step")
    ap.add_argument("--out", default="hf-trainer-out")
    ap.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --out")
    a = ap.parse_args(argv)
    trainer = Trainer(model=model(), args=training_args(a.out, a.steps, a.batch),
                      train_dataset=Counting())
    trainer.train(resume_from_checkpoint=a.resume or None)
    trainer.save_model(os.path.join(a.out, "final"))
    if trainer.args.process_index == 0:
        losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
        print(f"losses {losses}; saved {os.path.join(a.out, 'final')}")


if __name__ == "__main__":
    main()
