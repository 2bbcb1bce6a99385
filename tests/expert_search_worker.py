"""Run by tests/test_expert_search.py under torchrun (4 gloo ranks): the free search's
plan of a Mixtral-like model with wide experts (made in the test, with an expert axis the
search chose; its path in the case) trained by ``benchmarks/sweep_cases.run_dist`` as a
user runs it (``autopar.parallelize(plan=...)``, 3 SGD-momentum and 3 AdamW steps) and
compared with one device: the loss, every gradient, the weights after each step."""
from __future__ import annotations

import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "benchmarks")]
warnings.filterwarnings("ignore")

import sweep_cases as sc  # noqa: E402
from examples import zoo  # noqa: E402
from worker_loop import run_cases  # noqa: E402

from autopar.plan import Plan  # noqa: E402

WORLD = 4
CASE = sc.make_case("mixtral", "free-budget", WORLD, "mean")
"""The sweep case whose inputs, loss and comparison the run takes (batch ``CASE.batch``);
its model is :func:`wide_experts`, its plan the test's."""


def wide_experts(batch: int = CASE.batch, loss: str = "mean") -> zoo.Built:
    """A Mixtral-like model whose experts hold most of its parameters (4 experts, top 2,
    MLP 512 wide on a hidden size of 32), so that splitting them pays."""
    return zoo.causal_lm("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                         num_experts_per_tok=2, vocab_size=zoo.V, hidden_size=32,
                         intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, max_position_embeddings=64)(batch=batch, loss=loss)


def run_case(case: dict) -> dict:
    plan = Plan.load(case["plan"])
    # the sweep's run with this model and this plan (rank 0 "plans": it reads the test's)
    sc._model_inputs = lambda c: wide_experts(batch=c.batch, loss=c.loss)
    sc.plan_case = lambda c, b, captured=None: (plan, None)
    return sc.run_dist(CASE)


if __name__ == "__main__":
    run_cases(run_case)
