"""Run by tests/test_context_parallel.py under torchrun: transformers decoders with the
sequence split over a ``context`` mesh axis through the whole model, attention included
(``autopar.ops.context_attention``), on real gloo ranks.

Each case names a model (``MODELS``: Llama and Qwen2 with grouped-query attention and rotary
positions, GPT-2 with learned positions; all on SDPA), the pins of one plan and whether the
batch is padded (an attention mask with zeros at the end of some rows and ``ignore_index``
targets there). Every rank builds the same tiny model; ``autopar.parallelize`` plans it;
then 3 AdamW steps are compared with one device: the loss of every step, every gradient by
parameter name and the weights after the steps (``tests/equivalence.py``). GPT-2 steps with
SGD instead: its fused ``c_attn.bias`` holds the key bias, whose gradient is zero up to
rounding (softmax ignores a shift shared by a row), and AdamW turns that rounding noise into
steps of the full learning rate, on one device as on many, so its weights would compare noise
with noise. The result says
which SDPA nodes ran context-parallel (their key input split on the context axis) and each
rank's input shard, so the test can tell that the mode happened.
"""
from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import autopar  # noqa: E402
from autopar.analysis.saved import LOSS_GRADIENTS  # noqa: E402
from autopar.placement import Shard  # noqa: E402
from equivalence import compare, parallel_run, reference_run  # noqa: E402
from worker_loop import run_cases  # noqa: E402
from zoo import DEC, IGNORE, H, V, causal_lm, lm_loss, token_ids  # noqa: E402

GQA = {**DEC}            # 4 query heads, 2 key/value heads
MODELS = {
    "llama": lambda: causal_lm("LlamaConfig", "LlamaForCausalLM", attn="sdpa", **GQA)(),
    "qwen2": lambda: causal_lm("Qwen2Config", "Qwen2ForCausalLM", attn="sdpa", **GQA)(),
    "gpt2": lambda: causal_lm("GPT2Config", "GPT2LMHeadModel", attn="sdpa", vocab_size=V,
                              n_positions=64, n_embd=H, n_layer=2, n_head=4)(),
}


class Padded(torch.nn.Module):
    """``model(input_ids=ids, attention_mask=mask)``: a padded batch's forward."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask)


def padded_batch(ids: torch.Tensor, target: torch.Tensor):
    """An attention mask with the last ``k`` positions of row ``i`` padding (k cycles 0, 3,
    5, 1) and the targets there ``IGNORE``."""
    mask = torch.ones_like(ids)
    for i in range(ids.shape[0]):
        k = (0, 3, 5, 1)[i % 4]
        if k:
            mask[i, -k:] = 0
    return mask, torch.where(mask.bool(), target, IGNORE)


LONG = {**GQA, "max_position_embeddings": 1024}


def saved_bytes(pm, inputs, target) -> int:
    """Bytes of the distinct storages autograd saves for backward in one ``train_step`` on
    this rank: its activations (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in pm.module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pm.train_step(*inputs, target=target)
    return sum(seen.values())


def memory_case(case: dict) -> dict:
    """A sequence 4x longer than one rank's budget holds, on context=4: the activation bytes
    each rank saves against the plan's estimate."""
    from autopar.solver.errors import InfeasibleError
    seq = case["seq"]
    build = causal_lm("LlamaConfig", "LlamaForCausalLM", attn="sdpa", **LONG)
    short, long = build(batch=1), build(batch=1)
    ids = torch.randint(0, V, (1, seq), generator=torch.Generator().manual_seed(3))
    tgt = torch.randint(0, V, (1, seq), generator=torch.Generator().manual_seed(4))
    quarter = autopar.plan(short.model, (ids[:, :seq // 4],), lm_loss, target=tgt[:, :seq // 4],
                           world_size=1, cluster="cpu:1")
    budget = quarter.estimate.memory_total          # what one rank holds at a quarter
    try:
        autopar.plan(long.model, (ids,), lm_loss, target=tgt, world_size=1, cluster="cpu:1",
                     memory_budget=budget, recompute="none")
        fits_one = True
    except InfeasibleError:
        fits_one = False
    pm = autopar.parallelize(long.model, (ids,), lm_loss, target=tgt, context=4,
                             memory_budget=budget, recompute="none")
    measured = saved_bytes(pm, (ids,), tgt)
    # the loss's backward makes LOSS_GRADIENTS fp32 tensors of its input's (the logits')
    # local size beside the saved ones: the estimate's loss_grads, unseen by the hook
    transient = LOSS_GRADIENTS["cross_entropy_loss"] * 4 * (seq // 4) * V
    return {"fits_one_rank": fits_one, "budget": budget, "measured": measured,
            "estimate": pm.plan.estimate.memory_bytes.get("activations", 0.0),
            "loss_grads": pm.plan.estimate.memory_bytes.get("loss_grads", 0.0),
            "transient": transient,
            "memory_total": pm.plan.estimate.memory_total}


def run_case(case: dict) -> dict:
    if case.get("memory"):
        return memory_case(case)
    b = MODELS[case["model"]]()
    model, inputs, target = b.model, b.inputs, b.target
    if case.get("padded"):
        mask, target = padded_batch(inputs[0], target)
        model, inputs = Padded(model), (inputs[0], mask)
    pm = autopar.parallelize(model, inputs, lm_loss, target=target, **case["pins"])
    plan = pm.plan
    axis = plan.mesh_axes.index("context")
    ring = [n for n, p in plan.nodes.items() if "scaled_dot_product_attention" in n
            and p.input(1)[axis] == Shard(2)]
    opt = "sgd" if case["model"] == "gpt2" else "adamw"
    ref = reference_run(model, inputs, target, lm_loss, optimizer=opt)
    got = parallel_run(pm, inputs, target, optimizer=opt)
    worst = compare(ref, got, case["id"])
    local = sum(t.numel() for t in pm.module.parameters())      # this rank's parameter shards
    return {"worst": worst, "mesh": list(plan.mesh_shape), "axes": list(plan.mesh_axes),
            "param_numel": [local, sum(t.numel() for t in model.parameters())],
            "names": sorted(plan.params),
            "split_on_context": sorted(n for n, ph in plan.params.items()
                                       if isinstance(plan.nodes[ph].output(0)[axis], Shard)),
            "context_sdpa": ring, "n_sdpa": sum("scaled_dot_product_attention" in n for n in plan.nodes),
            "form": plan.options.context_attention,
            "layout": pm._stage_comm.settings.context_layout}


if __name__ == "__main__":
    run_cases(run_case)
