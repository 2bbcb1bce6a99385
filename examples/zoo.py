"""A zoo of tiny models kept as data: name -> :class:`Entry` (family, builder, the losses
that apply, tags). The differential sweep (``benchmarks/sweep.py``) draws from it, and
``tests/test_hf_models.py`` takes its Hugging Face builders from here.

Every model is built from a tiny config (hidden 32, 2 layers, vocabulary 128, sequence 16;
batch 4 unless the caller asks for another) with seeded random weights; nothing is
downloaded. Hugging Face models: every ``*drop*`` field 0, eager attention unless the name
says otherwise, no KV cache, and every weight moved by seeded noise (biases start at 0, and
a key bias has an exactly-zero gradient, so it would otherwise compare rounding noise).

``build(name, batch=4, loss="mean")`` returns a :class:`Built` (model, inputs, loss_fn,
target); ``loss`` is one of :data:`LOSSES` that the entry lists:

- ``mean``       cross-entropy, mean over the tokens / samples (MSE for regression heads)
- ``sum``        the same summed
- ``padded``     cross-entropy with ``ignore_index=-100``, targets padded by a run of -100 of
                 another length in every sample (token counts differ per micro-batch / rank)
- ``smoothing``  cross-entropy with ``label_smoothing=0.1``
- ``weighted``   cross-entropy with class weights (a tensor the loss closes over)
- ``own``        the model's own loss: labels passed as an input, ``loss_fn=None``

Each Built also carries :class:`LossSpec` ``spec``: how the loss decomposes into
micro-batch terms (for a one-device reference of BatchNorm models, whose statistics are
per micro-batch under accumulation and pipelines).

    from examples.zoo import ZOO, build
    b = build("llama", loss="padded")
    loss = b.loss_fn(b.model(*b.inputs), b.target)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

B, S, V, H = 4, 16, 128, 32
NUM_CLASSES = 10
IGNORE = -100
LOSSES = ("mean", "sum", "padded", "smoothing", "weighted", "own")
CE_LOSSES = ("mean", "sum", "padded", "smoothing", "weighted")


# ---- Hugging Face helpers (also used by tests/test_hf_models.py) ---------------------------

def _tf():
    import transformers
    return transformers


def zero_dropout(cfg):
    """Every ``*drop*`` field (dropout, *_pdrop, layerdrop, drop_path_rate) to 0."""
    for k, v in list(cfg.to_dict().items()):
        if "drop" in k and isinstance(v, (int, float)) and not isinstance(v, bool):
            setattr(cfg, k, 0.0)
    return cfg


def lm_loss(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def cls_loss(out, y):
    return F.cross_entropy(out.logits, y)


class OwnLoss(nn.Module):
    """``forward(x, labels) -> model(<input>=x, labels=labels).loss``: a model's own loss,
    with the labels an example input (autopar's inputs are positional)."""

    def __init__(self, model, input_name: str = "input_ids"):
        super().__init__()
        self.model = model
        self.input_name = input_name

    def forward(self, x, labels):
        return self.model(**{self.input_name: x}, labels=labels).loss


def token_ids(seed: int, n: int = S, batch: int = B) -> torch.Tensor:
    return torch.randint(0, V, (batch, n), generator=torch.Generator().manual_seed(seed))


def pixels(batch: int = B, size: int = 32) -> tuple:
    return (torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(5)),)


@dataclass
class LossSpec:
    """How a loss is the sum of micro-batch terms: ``term(out_k, y_k)`` summed over the
    micro-batches, divided by ``denominator(y)`` of the whole batch."""
    term: Callable | None = None          # None: the model's own loss (a mean of equal parts)
    denominator: Callable | None = None


@dataclass
class Built:
    model: torch.nn.Module
    inputs: tuple
    loss_fn: Callable | None
    target: object
    spec: LossSpec = field(default_factory=LossSpec)


def _perturb(m):
    # Hugging Face initializes biases to 0; a key bias also has an exactly-zero gradient
    # (softmax ignores a shift shared by a row), so its weights would stay rounding noise
    # and the relative weight comparison would compare noise with noise. Move every weight.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return m


def _model(cfg_cls, model_cls, kw, attn="eager", cache=True):
    cfg = zero_dropout(cfg_cls(**kw))
    if cache:
        cfg.use_cache = False
    torch.manual_seed(0)
    try:
        m = model_cls._from_config(cfg, attn_implementation=attn)
    except (ValueError, TypeError):       # models without an attention implementation
        m = model_cls(cfg)
    return _perturb(m)


# ---- losses --------------------------------------------------------------------------------

_CLASS_WEIGHTS: dict[int, torch.Tensor] = {}


def class_weights(n: int) -> torch.Tensor:
    if n not in _CLASS_WEIGHTS:
        _CLASS_WEIGHTS[n] = torch.linspace(0.5, 2.0, n)
    return _CLASS_WEIGHTS[n]


def _logits_of(hf: bool):
    return (lambda out: out.logits) if hf else (lambda out: out)


def ce_loss(kind: str, n_classes: int, hf: bool, model=None) -> tuple[Callable, LossSpec]:
    """A cross-entropy ``loss_fn(out, y)`` of kind ``kind`` over ``n_classes`` (logits of any
    leading shape, flattened), and its micro-batch decomposition. ``weighted``: the class
    weights are a buffer registered on ``model`` (``class_weight``), so the captured loss
    reads it; a tensor the loss closes over would be a constant export lifts to an input,
    which autopar refuses (CaptureError: "create it once in __init__ with
    self.register_buffer")."""
    get = _logits_of(hf)
    w = None
    if kind == "weighted":
        if model is None:
            raise ValueError("a class-weighted loss needs the model to hold its weights")
        if not hasattr(model, "class_weight"):
            model.register_buffer("class_weight", class_weights(n_classes).clone())
        w = class_weights(n_classes)
    kw = {"sum": dict(reduction="sum"), "padded": dict(ignore_index=IGNORE),
          "smoothing": dict(label_smoothing=0.1)}.get(kind, {})
    if kind not in CE_LOSSES:
        raise ValueError(f"unknown loss kind {kind!r}; known {LOSSES}")

    def weight():
        # read at call time: export swaps the module's buffers for its own while tracing, so
        # a reference taken before would be a constant
        return {"weight": model.class_weight} if kind == "weighted" else {}

    def cast(kw, x):        # a float64 reference run casts the model, not this buffer
        w = kw.get("weight")
        return {"weight": w.to(x.dtype)} if w is not None and w.dtype != x.dtype else kw

    def loss_fn(out, y):
        x = get(out)
        return F.cross_entropy(x.reshape(-1, x.shape[-1]), y.reshape(-1), **kw,
                               **cast(weight(), x))

    def term(out, y):
        x = get(out)
        return F.cross_entropy(x.reshape(-1, x.shape[-1]), y.reshape(-1),
                               **{**kw, "reduction": "sum"}, **cast(weight(), x))

    def denominator(y):
        y = y.reshape(-1)
        if kind == "sum":
            return 1.0
        if kind == "padded":
            return float((y != IGNORE).sum())
        if kind == "weighted":
            return float(w[y].sum())
        return float(y.numel())
    return loss_fn, LossSpec(term, denominator)


def mse(kind: str) -> tuple[Callable, LossSpec]:
    """Squared error, mean or sum (written out: ``F.mse_loss`` exports through a broadcast
    that makes the output depend on the target)."""
    if kind not in ("mean", "sum"):
        raise ValueError(f"regression losses are mean or sum, not {kind!r}")

    def loss_fn(out, y):
        d = (out - y) ** 2
        return d.mean() if kind == "mean" else d.sum()

    return loss_fn, LossSpec(lambda out, y: ((out - y) ** 2).sum(),
                             lambda y: float(y.numel()) if kind == "mean" else 1.0)


def pad_targets(y: torch.Tensor) -> torch.Tensor:
    """``y`` with runs of IGNORE: sample i of a (batch, seq) target keeps its first
    keep[i] tokens (keep cycles over 16, 3, 9, 0, 12, 1); a (batch,) target loses every
    third sample from the second."""
    y = y.clone()
    if y.dim() == 1:
        y[1::3] = IGNORE
        return y
    n = y.shape[1]
    keep = torch.tensor([n, 3, n // 2 + 1, 0, 3 * n // 4, 1])
    keep = keep.repeat(y.shape[0] // len(keep) + 1)[:y.shape[0]]
    return torch.where(torch.arange(n)[None, :] < keep[:, None], y, IGNORE)


def with_loss(model, inputs, target, kind: str, n_classes: int, hf: bool,
              own_input: str | None = None) -> Built:
    """``model`` with a loss of ``kind``: a cross-entropy over ``n_classes`` on its logits,
    or (``own``) its own loss with the target as the labels input."""
    if kind == "own":
        if own_input is None:
            raise ValueError("this model has no loss of its own")
        return Built(OwnLoss(model, own_input), (inputs[0], target), None, None)
    if kind == "padded":
        target = pad_targets(target)
    loss_fn, spec = ce_loss(kind, n_classes, hf, model)
    return Built(model, inputs, loss_fn, target, spec)


# ---- Hugging Face builders -----------------------------------------------------------------

def frozen_as_buffers(m):
    """Every parameter with ``requires_grad=False`` made a buffer of its module, the fix
    autopar's refusal of frozen parameters names (``runtime.parallel_module.refuse_frozen``):
    ERNIE 4.5's MoE gate keeps its score-correction bias as such a parameter."""
    for mod in m.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if not p.requires_grad:
                delattr(mod, name)
                mod.register_buffer(name, p.detach())
    return m


def skew_routers(m):
    """Zero every mixture-of-experts router (the module beside an experts module whose
    weight is [experts, hidden], and its biases): every score ties, so top-k sends every
    token to the first experts and the others receive none (DeepSeek-V3's group-limited
    routing: the first groups). The first step's routing is as skewed as routing gets."""
    from autopar.ops.experts import is_experts_module
    with torch.no_grad():
        for parent in m.modules():
            experts = [c for c in parent.children() if is_experts_module(c)]
            if not experts:
                continue
            n = experts[0].num_experts
            for c in parent.children():
                for name, p in c.named_parameters(recurse=False):
                    if c is not experts[0] and p.shape[:1] == (n,):
                        p.zero_()
                for name, b in c.named_buffers(recurse=False):
                    if b.shape[:1] == (n,) and b.is_floating_point():
                        b.zero_()
    return m


def causal_lm(cfg_cls, model_cls, own_loss=False, attn="eager", after=None, **kw):
    """A builder ``build(batch=B, loss="mean")`` of a language model (causal or masked) on
    (batch, S) token ids; ``own_loss``: the default loss is the model's own; ``after``: a
    change made to the built model (``skew_routers``)."""
    def build(batch: int = B, loss: str | None = None) -> Built:
        m = _model(_tf_attr(cfg_cls), _tf_attr(model_cls), kw, attn=attn)
        if after is not None:
            m = after(m)
        kind = loss or ("own" if own_loss else "mean")
        if kind == "mean":        # exactly tests/test_hf_models.py's
            return Built(m, (token_ids(1, batch=batch),), lm_loss, token_ids(2, batch=batch),
                         ce_loss("mean", V, True)[1])
        return with_loss(m, (token_ids(1, batch=batch),), token_ids(2, batch=batch), kind, V,
                         True, own_input="input_ids")
    return build


def image_cls(cfg_cls, model_cls, pixels_size: int = 32, **kw):
    def build(batch: int = B, loss: str = "mean") -> Built:
        m = _model(_tf_attr(cfg_cls), _tf_attr(model_cls), {**kw, "num_labels": NUM_CLASSES},
                   cache=False)
        y = torch.randint(0, NUM_CLASSES, (batch,), generator=torch.Generator().manual_seed(3))
        x = pixels(batch, pixels_size)
        if loss == "mean":
            return Built(m, x, cls_loss, y, ce_loss("mean", NUM_CLASSES, True)[1])
        return with_loss(m, x, y, loss, NUM_CLASSES, True, own_input="pixel_values")
    return build


def seq2seq(cfg_cls, model_cls, **kw):
    def build(batch: int = B, loss: str = "mean") -> Built:
        m = _model(_tf_attr(cfg_cls), _tf_attr(model_cls), kw)
        mask = torch.ones(batch, S, dtype=torch.long)
        inputs = (token_ids(1, batch=batch), mask, token_ids(4, batch=batch))
        y = token_ids(2, batch=batch)
        if loss == "mean":
            return Built(m, inputs, lm_loss, y, ce_loss("mean", V, True)[1])
        if loss == "own":
            return Built(OwnLoss(m), (inputs[0], y), None, None)
        b = with_loss(m, inputs, y, loss, V, True)
        return b
    return build


def _tf_attr(x):
    """A transformers class given by name (so this module imports without transformers)."""
    return getattr(_tf(), x) if isinstance(x, str) else x


DEC = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
ENC = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, max_position_embeddings=64)
NO_KV = {k: v for k, v in DEC.items() if k != "num_key_value_heads"}

HF_BUILDERS: dict[str, Callable] = {
    # decoders
    "gpt2": causal_lm("GPT2Config", "GPT2LMHeadModel", vocab_size=V, n_positions=64, n_embd=H,
                      n_layer=2, n_head=4),
    "gpt2-own-loss": causal_lm("GPT2Config", "GPT2LMHeadModel", own_loss=True, vocab_size=V,
                               n_positions=64, n_embd=H, n_layer=2, n_head=4),
    "llama": causal_lm("LlamaConfig", "LlamaForCausalLM", **DEC),
    "llama-tied": causal_lm("LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=True, **DEC),
    "llama-sdpa": causal_lm("LlamaConfig", "LlamaForCausalLM", attn="sdpa", **DEC),
    "llama-flex-attention": causal_lm("LlamaConfig", "LlamaForCausalLM", attn="flex_attention",
                                      **DEC),
    "mistral": causal_lm("MistralConfig", "MistralForCausalLM", **DEC),
    "qwen2": causal_lm("Qwen2Config", "Qwen2ForCausalLM", **DEC),
    "qwen3": causal_lm("Qwen3Config", "Qwen3ForCausalLM", head_dim=8, **DEC),
    "gemma": causal_lm("GemmaConfig", "GemmaForCausalLM", head_dim=8, **DEC),
    "gemma2": causal_lm("Gemma2Config", "Gemma2ForCausalLM", head_dim=8, sliding_window=8, **DEC),
    "phi": causal_lm("PhiConfig", "PhiForCausalLM", **DEC),
    "gpt_neox": causal_lm("GPTNeoXConfig", "GPTNeoXForCausalLM", **NO_KV),
    "opt": causal_lm("OPTConfig", "OPTForCausalLM", vocab_size=V, hidden_size=H, ffn_dim=64,
                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                     word_embed_proj_dim=H),
    "falcon": causal_lm("FalconConfig", "FalconForCausalLM", vocab_size=V, hidden_size=H,
                        num_hidden_layers=2, num_attention_heads=4),
    "bloom": causal_lm("BloomConfig", "BloomForCausalLM", vocab_size=V, hidden_size=H, n_layer=2,
                       n_head=4),
    # Gemma 3: a sliding-window layer and a global one (layer_types), q/k norms
    "gemma3": causal_lm("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"], **DEC),
    "phi3": causal_lm("Phi3Config", "Phi3ForCausalLM", pad_token_id=0, eos_token_id=None, **DEC),
    "granite": causal_lm("GraniteConfig", "GraniteForCausalLM", embedding_multiplier=2.0,
                         residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=2.0,
                         **DEC),
    "starcoder2": causal_lm("Starcoder2Config", "Starcoder2ForCausalLM", bos_token_id=None,
                            eos_token_id=None, **DEC),
    "olmo2": causal_lm("Olmo2Config", "Olmo2ForCausalLM", pad_token_id=0, eos_token_id=None, **DEC),
    "cohere": causal_lm("CohereConfig", "CohereForCausalLM", pad_token_id=0, eos_token_id=None, **DEC),
    # mixture of experts
    "mixtral": causal_lm("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                         num_experts_per_tok=2, **DEC),
    "mixtral-skewed": causal_lm("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                                num_experts_per_tok=2, after=skew_routers, **DEC),
    "qwen3_moe": causal_lm("Qwen3MoeConfig", "Qwen3MoeForCausalLM", head_dim=8, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                           output_router_logits=True, router_aux_loss_coef=0.1, **DEC),
    # DeepSeek-V3's form: a dense first layer, then MoE layers of 8 routed experts (top-2 of
    # 2 groups chosen among 4, sigmoid scores with a correction bias) and a shared expert,
    # multi-head latent attention
    "deepseek_v3": causal_lm("DeepseekV3Config", "DeepseekV3ForCausalLM", vocab_size=V,
                             hidden_size=H, intermediate_size=64, moe_intermediate_size=16,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                             max_position_embeddings=64, n_routed_experts=8, n_shared_experts=1,
                             num_experts_per_tok=2, n_group=4, topk_group=2,
                             first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                             qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=4),
    "deepseek_v3-skewed": causal_lm("DeepseekV3Config", "DeepseekV3ForCausalLM", vocab_size=V,
                                    hidden_size=H, intermediate_size=64, moe_intermediate_size=16,
                                    num_hidden_layers=3, num_attention_heads=4,
                                    num_key_value_heads=4, max_position_embeddings=64,
                                    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                    n_group=4, topk_group=2, first_k_dense_replace=1,
                                    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4,
                                    v_head_dim=8, qk_nope_head_dim=4, after=skew_routers),
    # Qwen2-MoE: routed experts and a gated shared expert
    "qwen2_moe": causal_lm("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32, decoder_sparse_step=1, **DEC),
    # Llama 4's text model: MoE layers (a routed expert and a shared one, sigmoid gate), a
    # layer without RoPE, chunked attention
    "llama4": causal_lm("Llama4TextConfig", "Llama4ForCausalLM", head_dim=8, num_local_experts=4,
                        num_experts_per_tok=1, intermediate_size_mlp=64,
                        interleave_moe_layer_step=1, no_rope_layers=[1, 0], attention_chunk_size=8,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None, **DEC),
    "granitemoe": causal_lm("GraniteMoeConfig", "GraniteMoeForCausalLM", num_local_experts=4,
                            num_experts_per_tok=2, **DEC),
    "ernie4_5_moe": causal_lm("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", moe_num_experts=4,
                              moe_k=2, moe_intermediate_size=32, moe_layer_start_index=0,
                              pad_token_id=0, bos_token_id=None, eos_token_id=None,
                              after=frozen_as_buffers, **DEC),
    # Qwen3-Next: a gated delta-net (linear attention) layer beside a full-attention one,
    # routed and shared experts
    "qwen3_next": causal_lm("Qwen3NextConfig", "Qwen3NextForCausalLM", head_dim=8, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, linear_num_value_heads=4,
                            linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                            layer_types=["linear_attention", "full_attention"], **DEC),
    "olmoe": causal_lm("OlmoeConfig", "OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                       output_router_logits=True, router_aux_loss_coef=0.1, eos_token_id=None,
                       pad_token_id=None, **DEC),
    "gpt_oss": causal_lm("GptOssConfig", "GptOssForCausalLM", vocab_size=V, hidden_size=H,
                         intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, num_local_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=64, sliding_window=8),
    # state space
    "mamba": causal_lm("MambaConfig", "MambaForCausalLM", vocab_size=V, hidden_size=H,
                       state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4),
    # encoders
    "bert": causal_lm("BertConfig", "BertForMaskedLM", **ENC),
    "roberta": causal_lm("RobertaConfig", "RobertaForMaskedLM", pad_token_id=1,
                         **{**ENC, "max_position_embeddings": 66}),
    "distilbert": causal_lm("DistilBertConfig", "DistilBertForMaskedLM", vocab_size=V, dim=H,
                            hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=64),
    "albert": causal_lm("AlbertConfig", "AlbertForMaskedLM", embedding_size=16, **ENC),
    # vision
    "vit": image_cls("ViTConfig", "ViTForImageClassification", image_size=32, patch_size=8,
                     num_channels=3, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4),
    "swin": image_cls("SwinConfig", "SwinForImageClassification", image_size=32, patch_size=4,
                      num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                      window_size=4),
    # 64 x 64 images: at 32 x 32 the last stage's maps are 1 x 1, and BatchNorm over a few
    # single values makes the model so ill-conditioned that fp32 itself is 1e-2 off
    "mobilevit": image_cls("MobileViTConfig", "MobileViTForImageClassification", image_size=64,
                           pixels_size=64,
                           hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 8, 16, 16, 16, 32],
                           num_attention_heads=2, expand_ratio=2.0),
    "resnet": image_cls("ResNetConfig", "ResNetForImageClassification", embedding_size=16,
                        hidden_sizes=[16, 32], depths=[1, 1]),
    "convnext": image_cls("ConvNextConfig", "ConvNextForImageClassification",
                          hidden_sizes=[16, 32], depths=[1, 1], num_stages=2),
    # encoder-decoder
    "t5": seq2seq("T5Config", "T5ForConditionalGeneration", vocab_size=V, d_model=H, d_kv=8,
                  d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0),
    "bart": seq2seq("BartConfig", "BartForConditionalGeneration", vocab_size=V, d_model=H,
                    encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                    max_position_embeddings=64),
}


# ---- autopar's own examples and torch's TransformerEncoder ---------------------------------

def _example(factory_name: str, kind_of_head: str, **kw):
    """A builder over ``examples.models`` / ``examples.unet`` factories: ``lm`` (logits
    (B, T, vocab)), ``cls`` (logits (B, classes)) or ``regression`` heads."""
    def build(batch: int = B, loss: str = "mean") -> Built:
        if factory_name == "unet":
            from examples.unet import unet_factory as factory
        else:
            from examples.models import EXAMPLES
            factory = EXAMPLES[factory_name]
        ex = factory(batch=batch, **kw)
        if kind_of_head == "regression":
            loss_fn, spec = mse(loss)
            return Built(ex.model, ex.inputs, loss_fn, ex.target, spec)
        with torch.no_grad():
            n = ex.model(*ex.inputs).shape[-1]      # classes (the vocabulary for lm heads)
        return with_loss(ex.model, ex.inputs, ex.target, loss, n, False)
    return build


class TorchEncoder(nn.Module):
    """torch's ``nn.TransformerEncoder`` (2 post-norm layers, batch first) between an
    embedding and a head over the vocabulary: a bidirectional token classifier."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        layer = nn.TransformerEncoderLayer(H, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(H, V)

    def forward(self, ids):
        return self.head(self.encoder(self.emb(ids)))


def torch_encoder(batch: int = B, loss: str = "mean") -> Built:
    torch.manual_seed(0)
    m = _perturb(TorchEncoder())
    return with_loss(m, (token_ids(1, batch=batch),), token_ids(2, batch=batch), loss, V, False)


# ---- the zoo -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    """One architecture: ``build(batch=4, loss="mean") -> Built``; ``losses`` the loss kinds
    that apply; ``tags``: ``batchnorm`` (statistics per micro-batch), ``tied`` (weights
    shared by two modules), ``shared`` (one layer's weights used by every layer),
    ``branches`` (independent towers: ``branch=``), ``own`` (returns its own loss)."""
    family: str
    build: Callable[..., Built]
    losses: tuple[str, ...] = CE_LOSSES
    tags: frozenset = frozenset()
    layers: int = 2


def _e(family, build, losses=CE_LOSSES, tags=(), layers=2):
    return Entry(family, build, tuple(losses), frozenset(tags), layers)


LM_OWN = CE_LOSSES + ("own",)
ZOO: dict[str, Entry] = {
    # autopar's examples
    "ex-gpt": _e("example", _example("gpt", "lm"), tags=("tied",)),
    # 4 layers: pipelines of 4 stages (interleaved 2 x 2) with a layer on every stage
    "ex-gpt-deep": _e("example", _example("gpt", "lm", n_layer=4), tags=("tied",), layers=4),
    "ex-llama": _e("example", _example("llama", "lm")),
    "ex-resnet": _e("example", _example("resnet", "cls"), ("mean", "sum", "smoothing"),
                    tags=("batchnorm",)),
    "ex-mlp": _e("example", _example("mlp", "regression"), ("mean", "sum"), layers=3),
    "ex-inception": _e("example", _example("inception", "cls"), tags=("branches",)),
    "ex-unet": _e("example", _example("unet", "regression"), ("mean", "sum")),
    # decoders
    "gpt2": _e("decoder", HF_BUILDERS["gpt2"], LM_OWN, tags=("tied",)),
    "llama": _e("decoder", HF_BUILDERS["llama"], LM_OWN),
    "llama-tied": _e("decoder", HF_BUILDERS["llama-tied"], tags=("tied",)),
    "llama-sdpa": _e("decoder", HF_BUILDERS["llama-sdpa"]),
    "mistral": _e("decoder", HF_BUILDERS["mistral"]),
    "qwen2": _e("decoder", HF_BUILDERS["qwen2"]),
    "qwen3": _e("decoder", HF_BUILDERS["qwen3"], LM_OWN),
    "gemma": _e("decoder", HF_BUILDERS["gemma"], tags=("tied",)),
    "gemma2": _e("decoder", HF_BUILDERS["gemma2"], tags=("tied",)),
    "phi": _e("decoder", HF_BUILDERS["phi"]),
    "gpt_neox": _e("decoder", HF_BUILDERS["gpt_neox"]),
    "opt": _e("decoder", HF_BUILDERS["opt"], tags=("tied",)),
    "falcon": _e("decoder", HF_BUILDERS["falcon"], tags=("tied",)),
    "bloom": _e("decoder", HF_BUILDERS["bloom"], tags=("tied",)),
    "gemma3": _e("decoder", HF_BUILDERS["gemma3"], tags=("tied",)),
    "phi3": _e("decoder", HF_BUILDERS["phi3"]),
    "granite": _e("decoder", HF_BUILDERS["granite"]),
    "starcoder2": _e("decoder", HF_BUILDERS["starcoder2"], tags=("tied",)),
    "olmo2": _e("decoder", HF_BUILDERS["olmo2"]),
    "cohere": _e("decoder", HF_BUILDERS["cohere"], tags=("tied",)),
    # mixture of experts, state space
    "mixtral": _e("moe", HF_BUILDERS["mixtral"]),
    "mixtral-skewed": _e("moe", HF_BUILDERS["mixtral-skewed"]),
    "qwen3_moe": _e("moe", HF_BUILDERS["qwen3_moe"], LM_OWN),
    "deepseek_v3": _e("moe", HF_BUILDERS["deepseek_v3"], LM_OWN, layers=3),
    "deepseek_v3-skewed": _e("moe", HF_BUILDERS["deepseek_v3-skewed"], layers=3),
    "qwen2_moe": _e("moe", HF_BUILDERS["qwen2_moe"], LM_OWN),
    "granitemoe": _e("moe", HF_BUILDERS["granitemoe"]),
    "llama4": _e("moe", HF_BUILDERS["llama4"]),
    "ernie4_5_moe": _e("moe", HF_BUILDERS["ernie4_5_moe"]),
    "qwen3_next": _e("moe", HF_BUILDERS["qwen3_next"]),
    "olmoe": _e("moe", HF_BUILDERS["olmoe"], LM_OWN),
    "gpt_oss": _e("moe", HF_BUILDERS["gpt_oss"]),
    "mamba": _e("state-space", HF_BUILDERS["mamba"], LM_OWN, tags=("tied",)),
    # encoders
    "bert": _e("encoder", HF_BUILDERS["bert"], LM_OWN, tags=("tied",)),
    "roberta": _e("encoder", HF_BUILDERS["roberta"], tags=("tied",)),
    "distilbert": _e("encoder", HF_BUILDERS["distilbert"], tags=("tied",)),
    "albert": _e("encoder", HF_BUILDERS["albert"], LM_OWN, tags=("shared", "tied")),
    "torch-encoder": _e("encoder", torch_encoder),
    # encoder-decoder
    "t5": _e("encoder-decoder", HF_BUILDERS["t5"], LM_OWN, tags=("tied",)),
    "bart": _e("encoder-decoder", HF_BUILDERS["bart"], LM_OWN, tags=("tied",)),
    # vision
    "resnet": _e("vision-conv", HF_BUILDERS["resnet"], ("mean", "sum", "smoothing", "own"),
                 tags=("batchnorm",)),
    "convnext": _e("vision-conv", HF_BUILDERS["convnext"], ("mean", "smoothing", "weighted")),
    "mobilevit": _e("vision-attention", HF_BUILDERS["mobilevit"], ("mean", "smoothing"),
                    tags=("batchnorm",)),
    "vit": _e("vision-attention", HF_BUILDERS["vit"], ("mean", "padded", "weighted", "own")),
    "swin": _e("vision-attention", HF_BUILDERS["swin"], ("mean", "sum", "smoothing")),
}
NAMES = sorted(ZOO)


def build(name: str, batch: int = B, loss: str = "mean") -> Built:
    """A fresh ``Built`` of architecture ``name`` (same weights every call)."""
    e = ZOO[name]
    if loss not in e.losses:
        raise ValueError(f"{name} takes the losses {e.losses}, not {loss!r}")
    return e.build(batch=batch, loss=loss)


@functools.lru_cache(maxsize=None)
def cached(name: str, batch: int = B, loss: str = "mean") -> Built:
    """:func:`build`, once per process (callers must copy the model before training it)."""
    return build(name, batch, loss)
