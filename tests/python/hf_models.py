"""Tiny random Hugging Face causal LMs of the four preset families, made in
the tests (no downloads), with every weight non-zero (transformers leaves
some at zero, which would hide gradients that do not flow)."""
import torch
import transformers

FAMILIES = ("llama", "qwen3", "qwen3_moe", "gpt_oss")
VOCAB = 320

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def config(family):
    if family == "llama":
        return transformers.LlamaConfig(tie_word_embeddings=False, **_COMMON)
    if family == "qwen3":
        return transformers.Qwen3Config(tie_word_embeddings=True, head_dim=16, **_COMMON)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, output_router_logits=True,
                                           router_aux_loss_coef=0.1, **_COMMON)
    if family == "gpt_oss":
        return transformers.GptOssConfig(
            head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            output_router_logits=True, router_aux_loss_coef=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **_COMMON)
    raise ValueError(family)


def model(family, seed=0):
    """A fresh fp32 model (same weights for the same seed), eager attention."""
    cfg = config(family)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    net = transformers.AutoModelForCausalLM.from_config(cfg).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            if not p.abs().sum():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return net


def batch(seed=1, rows=4, length=20):
    """input_ids, attention_mask (left padding on two rows), labels (-100 on
    the padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, :9] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels
