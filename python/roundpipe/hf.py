"""Hugging Face models as users load them (docs/hf.md).

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = roundpipe.wrap_model_to_roundpipe(model, optim_dtype=torch.float32)
    loss = model.forward_backward(input_kwargs={"input_ids": ids, "attention_mask": mask, "labels": ids},
                                  loss_fn=lambda out, _: out.loss)

``wrap_model_to_roundpipe`` (roundpipe.auto) turns a decoder-only causal LM
into the layers of a pipeline: embedding | one layer per decoder block |
final norm + LM head (roundpipe.hf_generic builds them; this module holds
their parts). ``LlamaForCausalLM``, ``Qwen3ForCausalLM``,
``Qwen3MoeForCausalLM`` and ``GptOssForCausalLM`` are the named presets: the
same layers, with their module layout checked. The layers hold the loaded
model's own modules (no second copy of any weight) and run transformers'
code for them, so the numerics are transformers'. What the presets add:

- The loss is transformers' ``ForCausalLMLoss`` (labels shifted inside,
  ``-100`` ignored, ``num_items_in_batch`` divides the summed loss), computed
  over chunks of tokens whose logits are recomputed in the backward pass:
  the full ``[tokens, vocab]`` logits never exist. Logits are returned when
  there are no labels, or with ``return_logits=True``.
- Mixture-of-experts blocks (Qwen3-MoE, GPT-OSS) run router and experts in
  their block's layer; with ``output_router_logits`` (the keyword or the
  config's) the auxiliary load-balancing loss is accumulated block by block
  and added as transformers adds it.
- Merged outputs of ``forward`` have the whole batch's loss: the token-weighted
  mean of the microbatch losses (or their sum with ``num_items_in_batch``).

Attribute reads (``config``, ``generation_config``, ``save_pretrained``,
``loss_function``, ...) fall through to the loaded model; after
``synchronize()`` its weights are the trained ones.
"""
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


IGNORE_INDEX = -100
# Tokens per loss chunk: the chunk's fp32 logits stay near 64 MiB.
_LOSS_CHUNK_ELEMENTS = 1 << 24

_FAMILIES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
}
_MOE_FAMILIES = ("qwen3_moe", "gpt_oss")

# The forward keywords of the presets (transformers' names).
_KEYWORDS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds", "labels", "shift_labels",
             "num_items_in_batch", "return_logits", "output_router_logits", "use_cache", "cache",
             "past_key_values", "logits_to_keep", "return_dict")


def _output_classes():
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    @dataclass
    class CausalLMOutput(CausalLMOutputWithPast):
        """transformers' output, plus how the loss was reduced (for merging)."""
        loss_denominator: torch.Tensor | None = None
        loss_reduction: str | None = None

    @dataclass
    class MoeCausalLMOutput(MoeCausalLMOutputWithPast):
        loss_denominator: torch.Tensor | None = None
        loss_reduction: str | None = None

    return {"dense": (CausalLMOutput, CausalLMOutputWithPast), "moe": (MoeCausalLMOutput, MoeCausalLMOutputWithPast)}


_OUTPUTS = None


def _outputs(kind):
    global _OUTPUTS
    if _OUTPUTS is None:
        _OUTPUTS = _output_classes()
    return _OUTPUTS[kind]


# ---------------------------------------------------------------------------
# The layers of a preset.

class _EmbeddingBase(nn.Module):
    """What every preset's embedding layer does with the Hugging Face
    keywords: checks them, starts the state the blocks pass along, and has
    ``_embed`` fill in the hidden states and what the blocks need."""

    def _init_call(self, hf, moe):
        self.router_logits_default = bool(getattr(hf.config, "output_router_logits", False))
        self.moe = moe

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                shift_labels=None, num_items_in_batch=None, return_logits=None, output_router_logits=None,
                use_cache=None, cache=None, past_key_values=None, logits_to_keep=0, return_dict=None, **extra):
        if extra:
            raise TypeError(f"unexpected keyword argument(s) {sorted(extra)}; the Hugging Face presets take "
                            f"{', '.join(_KEYWORDS)}")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if use_cache or cache is not None or past_key_values is not None:
            raise ValueError("the pipeline keeps no key/value cache: call without use_cache / cache "
                             "(to generate, synchronize() and call the Hugging Face model itself)")
        if return_dict is False:
            raise ValueError("return_dict=False is not supported: the presets return transformers' output "
                             "objects")
        if not isinstance(logits_to_keep, int) or isinstance(logits_to_keep, bool) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an int >= 0, got {logits_to_keep!r}")
        if output_router_logits is None:
            output_router_logits = self.router_logits_default
        router = None
        if output_router_logits and self.moe:
            # Load-balancing sums over the blocks: tokens per expert, router
            # probability per expert, rows counted (transformers' formula).
            router = {"tokens": None, "probs": None, "rows": None}
        state = {
            "hidden_states": None, "attention_mask": attention_mask, "position_ids": position_ids,
            "labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch,
            "return_logits": return_logits, "logits_to_keep": logits_to_keep, "router": router,
            "sequence_tile": self.tile_setting.value if hasattr(self, "tile_setting") else None,
        }
        self._embed(state, input_ids, inputs_embeds)
        return state

    def _embed(self, state, input_ids, inputs_embeds):
        raise NotImplementedError


class _RouterCapture(nn.Module):
    """What a decoder block adds for the auxiliary load-balancing loss: the
    router logits its router modules return, accumulated block by block."""

    def _init_router(self, hf):
        self.router_names = []
        recorder = (getattr(type(hf), "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is None or not _has_aux_loss(hf):
            return
        self.router_index = recorder.index or 0
        self.router_names = [name for name, m in self.block.named_modules()
                             if isinstance(m, recorder.target_class)]
        self.num_experts = hf.num_experts
        self.top_k = hf.num_experts_per_tok

    def _run_block(self, state, args, kwargs, tiles=None):
        """The block's call, with its router logits added to state's sums.
        ``tiles``: a roundpipe.hf_generic.TiledParts that runs the block's
        position-wise parts over tiles of the sequence (it captures the
        router logits of the routers inside them)."""
        router = state["router"]
        captured = []
        hooks = []
        if router is not None:
            for name in self.router_names:
                if tiles is not None and tiles.covers(name):
                    continue
                hooks.append(self.block.get_submodule(name).register_forward_hook(
                    lambda _m, _i, out: captured.append(out[self.router_index])))
        try:
            if tiles is None:
                out = self.block(state["hidden_states"], *args, **kwargs)
            else:
                with tiles.active(captured if router is not None else None):
                    out = self.block(state["hidden_states"], *args, **kwargs)
        finally:
            for h in hooks:
                h.remove()
        state = dict(state)
        state["hidden_states"] = out[0] if isinstance(out, tuple) else out
        if router is not None:
            state["router"] = self._accumulate(router, captured, state["attention_mask"])
        return state

    def _accumulate(self, router, captured, attention_mask):
        """transformers' load_balancing_loss_func, one block at a time."""
        router = dict(router)
        for logits in captured:
            device = logits.device
            tokens = router["tokens"] if router["tokens"] is not None else torch.zeros(
                self.num_experts, dtype=torch.float32, device=device)
            probs = router["probs"] if router["probs"] is not None else torch.zeros(
                self.num_experts, dtype=torch.float32, device=device)
            rows = router["rows"] if router["rows"] is not None else torch.zeros((), dtype=torch.float32,
                                                                                 device=device)
            weights = F.softmax(logits, dim=-1)
            _, selected = torch.topk(weights, self.top_k, dim=-1)
            if attention_mask is None:
                histc_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
                tokens = tokens + torch.histc(selected.reshape(-1).to(histc_dtype), bins=self.num_experts,
                                              min=0, max=self.num_experts)
                probs = probs + weights.float().sum(dim=0)
                rows = rows + weights.shape[0]
            else:
                flat = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
                tokens = tokens + torch.zeros(self.num_experts, dtype=torch.float32, device=device).scatter_add_(
                    0, selected.reshape(-1), flat.repeat_interleave(self.top_k))
                probs = probs + (weights.float() * flat.unsqueeze(-1)).sum(dim=0)
                rows = rows + flat.sum()
            router.update(tokens=tokens, probs=probs, rows=rows)
        return router


def _has_aux_loss(hf):
    """Whether the causal LM adds transformers' load-balancing loss."""
    return all(hasattr(hf, a) for a in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")) and \
        "router_logits" in (getattr(type(hf), "_can_record_outputs", None) or {})


class LogitTransform:
    """What a causal LM does to its LM head's output before the loss, read
    from its config: Cohere's ``logit_scale`` (a product), Granite's
    ``logits_scaling`` (a quotient), Gemma 2/3's ``final_logit_softcapping``
    (``cap * tanh(logits / cap)``), in the model's dtype as transformers
    computes them."""

    def __init__(self, hf):
        config = hf.config
        scale = getattr(hf, "logit_scale", None)
        self.scale = float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None
        scaling = getattr(config, "logits_scaling", None)
        self.divisor = float(scaling) if scaling not in (None, 1, 1.0) else None
        cap = getattr(config, "final_logit_softcapping", None)
        self.softcap = float(cap) if cap else None

    def __call__(self, logits):
        if self.scale is not None:
            logits = logits * self.scale
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _chunk_loss(hidden, weight, bias, labels, transform):
    logits = transform(F.linear(hidden, weight, bias)).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


class HFHead(nn.Module):
    """Final norm and LM head; the causal-LM loss in chunks of tokens.
    ``norm`` and ``lm_head`` are the loaded model's modules."""

    def __init__(self, hf, norm, lm_head):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.vocab_size = hf.config.vocab_size
        self.transform = LogitTransform(hf)
        self.kind = "moe" if _has_aux_loss(hf) else "dense"
        self.chunk_tokens = max(1, _LOSS_CHUNK_ELEMENTS // self.vocab_size)
        if self.kind == "moe":
            self.router_aux_loss_coef = hf.router_aux_loss_coef
            self.num_experts = hf.num_experts

    def forward(self, state):
        hidden = self.norm(state["hidden_states"])
        labels, shift_labels = state["labels"], state["shift_labels"]
        keep = state["logits_to_keep"]
        fields = {}
        has_labels = labels is not None or shift_labels is not None
        if not has_labels or state["return_logits"]:
            kept = hidden[:, -keep:, :] if keep else hidden
            fields["logits"] = self.transform(self.lm_head(kept))
        if has_labels:
            fields.update(self._loss(hidden, labels, shift_labels, state["num_items_in_batch"]))
        router = state["router"]
        if router is not None and router["tokens"] is not None:
            aux = torch.sum((router["tokens"] / router["rows"]) * (router["probs"] / router["rows"]).unsqueeze(0))
            fields["aux_loss"] = aux * self.num_experts
            if "loss" in fields:
                fields["loss"] = fields["loss"] + self.router_aux_loss_coef * fields["aux_loss"]
        cls, _ = _outputs(self.kind)
        return cls(**fields)

    def _loss(self, hidden, labels, shift_labels, num_items):
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        targets = shift_labels.reshape(-1).to(hidden.device)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if targets.numel() != flat.shape[0]:
            raise ValueError(f"labels have {targets.numel()} tokens but the inputs have {flat.shape[0]}")
        weight, bias = self.lm_head.weight, self.lm_head.bias
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, flat.shape[0], self.chunk_tokens):
            end = start + self.chunk_tokens
            total = total + checkpoint(_chunk_loss, flat[start:end], weight, bias, targets[start:end], self.transform,
                                       use_reentrant=False, preserve_rng_state=False)
        if num_items is None:
            denominator = (targets != IGNORE_INDEX).sum().to(torch.float32)
            reduction = "mean"
        else:
            denominator = torch.as_tensor(num_items, device=total.device).to(torch.float32)
            reduction = "sum"
        return {"loss": total / denominator, "loss_denominator": denominator.detach(),
                "loss_reduction": reduction}


# ---------------------------------------------------------------------------
# Merging the microbatches' outputs into the whole batch's.

def merge_hf_outputs(outputs):
    """One output for the batch: logits concatenated, the loss as the
    unsplit model computes it (token-weighted mean, or the sum of the parts
    over ``num_items_in_batch``), the auxiliary loss averaged."""
    first = outputs[0]
    kind = "moe" if hasattr(first, "aux_loss") else "dense"
    _, plain = _outputs(kind)
    fields = {}
    if first.get("logits") is not None:
        fields["logits"] = torch.cat([o["logits"] for o in outputs], dim=0)
    if first.get("loss") is not None:
        losses = torch.stack([o["loss"] for o in outputs])
        if first["loss_reduction"] == "sum":
            fields["loss"] = losses.sum()
        else:
            weights = torch.stack([o["loss_denominator"].to(losses.device) for o in outputs])
            fields["loss"] = (losses * weights).sum() / weights.sum()
    if first.get("aux_loss") is not None:
        fields["aux_loss"] = torch.stack([o["aux_loss"] for o in outputs]).mean()
    return plain(**fields)


# ---------------------------------------------------------------------------
# Wrapping.

def _base_model(model):
    """The transformers model inside a peft model (adapters injected in place)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and type(model).__name__.startswith("Peft") else model


def _family(model):
    model = _base_model(model)
    for cls in type(model).__mro__:
        if cls.__name__ in _FAMILIES:
            return _FAMILIES[cls.__name__]
    return None


def _refuse_packed_experts(model):
    for name, module in model.named_modules():
        packed = [p for p in module._parameters if p.endswith("_blocks") or p.endswith("_scales")]
        if "mxfp4" in type(module).__name__.lower() or packed:
            raise ValueError(
                f"wrap_model_to_roundpipe: {name or 'the model'} ({type(module).__name__}) holds packed MXFP4 "
                "expert weights, which cannot be trained. Load the model dequantized: "
                "from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16)")
