"""Tiny random configs of Hugging Face decoder architectures (fp32, no
dropout), for the generic decoder preset's tests and B11."""
import torch

VOCAB = 96

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
               attention_dropout=0.0, tie_word_embeddings=False)

# model_type -> config fields over _COMMON (None: drop the field)
ARCHITECTURES = {
    "mistral": dict(sliding_window=6),
    "qwen2": dict(use_sliding_window=True, sliding_window=6, max_window_layers=1,
                  layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
    "gemma": dict(tie_word_embeddings=True),
    "gemma2": dict(sliding_window=6, final_logit_softcapping=5.0, attn_logit_softcapping=20.0, query_pre_attn_scalar=8,
                   tie_word_embeddings=True),
    "gemma3_text": dict(sliding_window=6, final_logit_softcapping=5.0, query_pre_attn_scalar=8, sliding_window_pattern=2,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        rope_local_base_freq=1000.0, tie_word_embeddings=True),
    "phi3": dict(resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0),
    "olmo": dict(),
    "olmo2": dict(),
    "granite": dict(logits_scaling=2.0, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=24,
                      decoder_sparse_step=1, output_router_logits=True, router_aux_loss_coef=0.02),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8,
                        num_key_value_heads=4, rope_interleave=True),
    "gpt_neox": dict(rotary_pct=0.5, use_parallel_residual=True, hidden_dropout=0.0, classifier_dropout=0.0,
                     num_key_value_heads=None, head_dim=None),
    "gpt2": None,  # its own field names
    "phi": dict(resid_pdrop=0.0, embd_pdrop=0.0, partial_rotary_factor=0.5, num_key_value_heads=4, head_dim=None),
    "cohere": dict(logit_scale=0.5, use_qk_norm=True),
    "starcoder2": dict(sliding_window=6, residual_dropout=0.0, embedding_dropout=0.0, use_bias=True),
    "stablelm": dict(partial_rotary_factor=0.5, use_qkv_bias=True, hidden_dropout=0.0),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02),
    "jamba": dict(num_experts=2, num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1,
                  attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=2, mamba_expand=2,
                  mamba_dt_rank=4, use_mamba_kernels=False, output_router_logits=False),
}


def tiny_config(model_type, **overrides):
    from transformers import CONFIG_MAPPING
    fields = ARCHITECTURES[model_type] if model_type in ARCHITECTURES else PRESET_ARCHITECTURES[model_type]
    if fields is None:
        values = dict(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=128, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    else:
        values = dict(_COMMON)
        for k, v in fields.items():
            if v is None:
                values.pop(k, None)
            else:
                values[k] = v
    values.update(overrides)
    return CONFIG_MAPPING[model_type](**values)


# The preset families' configs, for comparisons with the generic preset.
PRESET_ARCHITECTURES = {"llama": dict(), "qwen3": dict(tie_word_embeddings=True)}


def tiny_model(model_type, dtype=torch.float32, seed=0, **overrides):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=dtype)
    return model
