"""Presets against Hugging Face transformers (LlamaForCausalLM,
Qwen3ForCausalLM, eager attention) on tiny random configs: logits, loss and
every gradient, fp32, on the devices of ROUNDPIPE_DEVICES (transformers runs
on the GPU when there is one). transformers is a test dependency (requirements-dev.txt)."""
import pytest
import torch
import transformers

from roundpipe import RoundPipe, RoundPipeRunConfig, presets

TOLERANCE = 1e-5  # relative to the largest value; fp32 with different kernel orders


def hf_model(arch):
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6)
    if arch == "llama":
        cfg = transformers.LlamaConfig(tie_word_embeddings=False, **common)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Qwen3Config(tie_word_embeddings=True, head_dim=32, **common)
        cls = transformers.Qwen3ForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(cfg).float(), cfg


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_preset_matches_transformers(arch):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf, hf_cfg = hf_model(arch)
    cfg = presets.config_from_hf(hf_cfg.to_json_string(use_diff=False))
    assert (cfg.model_type, cfg.tie_word_embeddings, cfg.head_size) == (
        arch, hf_cfg.tie_word_embeddings, hf_cfg.head_dim)
    net = presets.make_decoder(cfg)
    presets.load_hf_weights(net, cfg, {k: v.detach() for k, v in hf.state_dict().items()})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = hf.to(device)

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (4, 48), generator=g)
    hf_labels = torch.randint(0, cfg.vocab_size, (4, 48), generator=g)
    hf_labels[:, :5] = -100
    # transformers shifts inside; roundpipe's labels are aligned with positions.
    labels = torch.cat([hf_labels[:, 1:], torch.full((4, 1), -100)], dim=1)

    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=1))
    worst = {}
    with torch.no_grad():
        worst["logits"] = rel(model.forward(ids), hf(ids.to(device)).logits.cpu())
    loss = model.forward_backward(input_args=(ids,), input_kwargs={"labels": labels}, loss_fn=presets.loss_fn)
    model.synchronize()
    out = hf(ids.to(device), labels=hf_labels.to(device))
    out.loss.backward()
    worst["loss"] = rel(torch.as_tensor(loss), out.loss.detach().cpu())
    ours = dict(net.named_parameters())
    theirs = dict(hf.named_parameters())
    for our_name, hf_name in presets.hf_parameter_names(cfg):
        worst["grad " + hf_name] = rel(ours[our_name].grad, theirs[hf_name].grad.cpu())
    name, value = max(worst.items(), key=lambda kv: kv[1])
    print(f"RESULT id=hf-{arch} device={device} worst={name} rel={value:.3g} "
          f"logits={worst['logits']:.3g} loss={worst['loss']:.3g} transformers={transformers.__version__}")
    assert value <= TOLERANCE, worst
