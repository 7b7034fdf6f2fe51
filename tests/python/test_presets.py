"""Presets (roundpipe.presets) against an independent plain-PyTorch implementation of
the same architectures (reference_decoder.py): logits, loss and every
gradient, fp32, relative 1e-5, on cpu:1 and cpu:3; Hugging Face weight
loading; the layers behave as nn.Modules."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from roundpipe import presets, safetensors

TESTS = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent('''
    import sys, torch
    sys.path.insert(0, {tests!r})
    import roundpipe
    from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig, presets
    from reference_decoder import RefConfig, RefDecoder
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = getattr(presets, "tiny_{arch}_config")()
    cfg.num_hidden_layers = 3
    cfg.loss_chunk_size = 50  # several chunks per microbatch
    net = presets.make_decoder(cfg)
    ref = RefDecoder(RefConfig.of(cfg))
    ours = dict(net.named_parameters())
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for our_name, hf_name in presets.hf_parameter_names(cfg):
            ref_params[hf_name].copy_(ours[our_name])
    assert len(ref_params) == len(presets.hf_parameter_names(cfg))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (6, 40), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (6, 40), generator=g)
    labels[:, :3] = -100
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    assert roundpipe.get_num_devices() == {devices}

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    worst = {{}}
    with torch.no_grad():
        worst["logits"] = rel(model.forward(ids), ref(ids))
    # Each microbatch's loss is the mean over its rows; their sum / 3 is the
    # batch mean because every microbatch counts the same number of labels.
    loss = model.forward_backward(input_args=(ids,), input_kwargs={{"labels": labels}},
                                  loss_fn=lambda out, _: out / 3)
    model.synchronize()
    ref_loss = torch.stack([ref(ids[i:i + 2], labels[i:i + 2]) for i in range(0, 6, 2)]).mean()
    ref_loss.backward()
    worst["loss"] = rel(torch.as_tensor(sum(loss) if isinstance(loss, list) else loss), ref_loss.detach())
    for our_name, hf_name in presets.hf_parameter_names(cfg):
        worst["grad " + our_name] = rel(ours[our_name].grad, ref_params[hf_name].grad)
    name, value = max(worst.items(), key=lambda kv: kv[1])
    print("worst", name, value)
    assert value <= 1e-5, worst
''')


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("devices", [1, 3])
def test_preset_matches_independent_pytorch(tmp_path, arch, devices):
    script = tmp_path / "check.py"
    script.write_text(SCRIPT.format(tests=TESTS, arch=arch, devices=devices))
    env = dict(os.environ, ROUNDPIPE_DEVICES=f"cpu:{devices}")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "worst" in done.stdout


def test_layers_are_modules_over_the_native_tensors():
    cfg = presets.tiny_qwen3_config()
    net = presets.make_decoder(cfg)
    assert len(net) == cfg.num_hidden_layers + 2
    names = [n for n, _ in net.named_parameters()]
    assert names[0] == "0.embed_tokens.weight" and "1.self_attn.q_norm.weight" in names
    # Tied head: one tensor, listed once.
    assert net[-1].lm_head.weight is net[0].embed_tokens.weight
    assert "5.lm_head.weight" not in names
    assert all(isinstance(p, torch.nn.Parameter) for p in net.parameters())
    # Direct calls run the C++ forward: changing a parameter from Python changes it.
    ids = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        before = net[-1](net[2](net[1](net[0](ids))))
        net[-1].norm.weight.mul_(2)
        after = net[-1](net[2](net[1](net[0](ids))))
    assert before.shape == (2, 8, 256) and not torch.equal(before, after)
    net[1].requires_grad_(False)
    assert not any(p.requires_grad for p in net[1].parameters())
    net.eval()
    assert not net[1].training
    assert "DecoderBlock" in repr(net)


def test_hf_weights_load_by_name(tmp_path):
    cfg = presets.tiny_llama_config()
    src = presets.make_decoder(cfg)
    params = dict(src.named_parameters())
    hf = {theirs: params[ours].detach().clone() for ours, theirs in presets.hf_parameter_names(cfg)}
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # extra: ignored
    safetensors.save_file(hf, tmp_path / "model.safetensors")
    dst = presets.make_decoder(cfg)
    presets.load_hf_weights(dst, cfg, tmp_path)
    for (name, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert torch.equal(a, b), name
    del hf["model.norm.weight"]
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(ValueError, match="model.norm.weight"):
        presets.load_hf_weights(presets.make_decoder(cfg), cfg, hf)
    hf["model.norm.weight"] = torch.ones(7)
    with pytest.raises(ValueError, match=r"shape \(7,\)"):
        presets.load_hf_weights(dst, cfg, hf)
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())


def test_config_from_hugging_face_json(tmp_path):
    hf = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "tie_word_embeddings": True, "rope_theta": 1000000.0}
    (tmp_path / "config.json").write_text(__import__("json").dumps(hf))
    cfg = presets.load_config(tmp_path)
    assert (cfg.model_type, cfg.head_size, cfg.kv_heads, cfg.qk_norm) == ("qwen3", 16, 2, True)
    with pytest.raises(ValueError, match="hidden_size"):
        presets.config_from_hf(dict(hf, hidden_size=-1))
    with pytest.raises(ValueError, match="cannot read"):
        presets.load_config(tmp_path / "missing.json")
    with pytest.raises(TypeError):
        presets.make_decoder({"model_type": "llama"})


def test_lora_trains_only_the_adapters():
    from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig
    from roundpipe.optim import AdamW
    torch.manual_seed(0)
    cfg = presets.tiny_llama_config()
    cfg.num_hidden_layers = 2
    net = presets.make_decoder(cfg)
    ids = torch.randint(0, 256, (4, 32))
    with torch.no_grad():
        base_logits = net[3](net[2](net[1](net[0](ids))))
    assert presets.apply_lora(net, rank=4, alpha=8, target_modules=["q_proj", "v_proj"]) == 4
    adapters = presets.lora_state_dict(net)
    assert sorted(adapters)[:2] == ["1.self_attn.q_proj.lora_A", "1.self_attn.q_proj.lora_B"]
    with torch.no_grad():
        assert torch.equal(net[3](net[2](net[1](net[0](ids)))), base_logits)  # B starts at zero
    base = {n: p.detach().clone() for n, p in net.named_parameters() if ".lora_" not in n}
    lora = {n: p.detach().clone() for n, p in adapters.items()}
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    assert len(list(model.optim_parameters())) == len(adapters)
    with OptimizerCtx():
        opt = AdamW(model.parameters(), lr=1e-2)
    labels = torch.roll(ids, -1, 1)
    losses = []
    for _ in range(6):
        losses.append(float(model.forward_backward(input_args=(ids,), input_kwargs={"labels": labels},
                                                   loss_fn=lambda out, _: out / 2)))
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    assert losses[-1] < losses[0]
    for n, p in net.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]) and p.grad is None, n
        else:
            assert not torch.equal(p, lora[n]), n
    with pytest.raises(ValueError, match="twice"):
        presets.apply_lora(net)
    with pytest.raises(ValueError, match="rank"):
        presets.apply_lora(presets.make_decoder(cfg), rank=0)
