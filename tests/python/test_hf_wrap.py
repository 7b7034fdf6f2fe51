"""wrap_model_to_roundpipe against transformers (docs/hf.md): on tiny random
models of the four families, in processes with 1 and 3 CPU devices, the
logits, the loss (padding; whole-batch mean and num_items_in_batch over
microbatches; the load-balancing loss of the MoE families), every gradient,
and every parameter after three optimizer steps, fp32, 1e-5 relative."""
import copy
import textwrap

import pytest
import torch

import roundpipe
from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe

import hf_models
from device_reports import device_reports

TOLERANCE = 1e-5

SCRIPT = textwrap.dedent('''
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    import hf_models
    from roundpipe import OptimizerCtx, RoundPipeRunConfig, get_num_devices, wrap_model_to_roundpipe
    torch.set_num_threads(1)

    def rel(a, b):
        a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    report = {{"devices": get_num_devices()}}
    for family in hf_models.FAMILIES:
        hf, ref = hf_models.model(family), hf_models.model(family)
        ids, mask, labels = hf_models.batch()
        model = wrap_model_to_roundpipe(hf, model_run_config=RoundPipeRunConfig(num_microbatch=3))
        model.model[-1].chunk_tokens = 7  # several loss chunks per microbatch
        worst = {{}}
        # The load-balancing loss is not additive over microbatches: the
        # whole batch's cross-entropy with it off, and it on one microbatch.
        moe = {{"output_router_logits": False}} if family in ("qwen3_moe", "gpt_oss") else {{}}
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, labels=labels, return_logits=True, **moe)
            want = ref(input_ids=ids, attention_mask=mask, labels=labels, **moe)
        worst["logits"] = rel(out.logits, want.logits)
        worst["loss (mean over the batch)"] = rel(out.loss, want.loss)
        if moe:
            one = RoundPipeRunConfig(num_microbatch=1)
            with torch.no_grad():
                out1 = model(input_ids=ids, attention_mask=mask, labels=labels, roundpipe_run_config=one)
                want = ref(input_ids=ids, attention_mask=mask, labels=labels)
            worst["aux_loss"] = rel(out1.aux_loss, want.aux_loss)
            worst["loss with aux_loss (one microbatch)"] = rel(out1.loss, want.loss)
        with OptimizerCtx():
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        n = (labels[:, 1:] != -100).sum()
        kwargs = {{"input_ids": ids, "attention_mask": mask, "labels": labels, "num_items_in_batch": n}}
        worst["loss (num_items_in_batch)"] = worst["every gradient"] = 0.0
        for step in range(3):
            loss = model.forward_backward(input_kwargs=kwargs, loss_fn=lambda o, _: o.loss)
            # The reference: the loop that defines forward_backward, each
            # microbatch through transformers; for the dense families also
            # the whole batch at once.
            ref_loss = 0.0
            for part in zip(*(t.tensor_split(3) for t in (ids, mask, labels))):
                chunk = dict(zip(("input_ids", "attention_mask", "labels"), part), num_items_in_batch=n)
                part_loss = ref(**chunk).loss
                part_loss.backward()
                ref_loss = ref_loss + part_loss.detach()
            if family in ("llama", "qwen3"):
                with torch.no_grad():
                    whole = ref(**kwargs).loss
                worst["loss (num_items_in_batch)"] = max(worst["loss (num_items_in_batch)"], rel(ref_loss, whole))
            worst["loss (num_items_in_batch)"] = max(worst["loss (num_items_in_batch)"], rel(loss, ref_loss))
            model.synchronize()
            for p, q in zip(hf.parameters(), ref.parameters()):
                worst["every gradient"] = max(worst["every gradient"], rel(p.grad, q.grad))
            model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
            ref_opt.step()
            ref_opt.zero_grad()
        worst["parameters after 3 steps"] = max(rel(p, q) for p, q in zip(hf.parameters(), ref.parameters()))
        report[family] = worst
    print(json.dumps(report))
''')


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return device_reports(tmp_path_factory, "hf", SCRIPT, timeout=600)


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("family", hf_models.FAMILIES)
def test_preset_matches_transformers(reports, family, devices):
    report = reports[devices]
    assert report["devices"] == devices
    worst = report[family]
    print(f"{family} on {devices} device(s): " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    assert set(worst) >= {"logits", "loss (mean over the batch)", "loss (num_items_in_batch)", "every gradient",
                          "parameters after 3 steps"}
    bad = {k: v for k, v in worst.items() if not v <= TOLERANCE}
    assert not bad, f"{family} on {devices} device(s) differs from transformers: {bad}"


# ---------------------------------------------------------------------------
# The workflow around the presets (this process's devices).

def _train(model, steps=2, lr=0.1):
    from roundpipe import OptimizerCtx
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    ids, mask, labels = hf_models.batch()
    for _ in range(steps):
        model.forward_backward(input_kwargs={"input_ids": ids, "attention_mask": mask, "labels": labels},
                               loss_fn=lambda out, _: out.loss)
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()


def test_wrapped_model_shares_the_loaded_weights_and_falls_through_to_it():
    hf = hf_models.model("qwen3")
    params = dict(hf.named_parameters())
    model = wrap_model_to_roundpipe(hf)
    assert isinstance(model, roundpipe.RoundPipe) and isinstance(model, torch.nn.Module)
    assert model.config is hf.config and model.generation_config is hf.generation_config
    assert model.loss_function is not None and model.save_pretrained.__self__ is hf
    # The layers hold the loaded modules: no second copy of any weight.
    assert model.model[0].prelude.embed_tokens is hf.model.embed_tokens
    assert model.model[-1].lm_head is hf.lm_head and model.model[1].block is hf.model.layers[0]
    ours = {id(p) for p in model.parameters()}
    assert ours == {id(p) for p in params.values()}
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # tied, and trained once
    assert len(list(model.optim_parameters())) == len(params)


def test_save_pretrained_writes_the_trained_weights(tmp_path):
    import transformers
    hf = hf_models.model("llama")
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    model = wrap_model_to_roundpipe(hf)
    _train(model)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    changed = 0
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, hf.state_dict()[name]), name
        changed += not torch.equal(t, before[name])
    assert changed == len(before)


def test_lora_through_peft_trains_only_the_adapters_as_peft_does():
    import copy
    import peft
    base = hf_models.model("llama")
    ref = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for p, q in zip(lora.parameters(), ref.parameters()):
            if not p.abs().sum():  # lora_B starts at zero: give the test gradients to see
                p.normal_(0, 0.05)
            q.copy_(p)
    frozen = {n: p.clone() for n, p in lora.named_parameters() if not p.requires_grad}
    model = wrap_model_to_roundpipe(lora)
    assert all("lora_" in n for n, _ in model.optim_named_parameters())
    _train(model, steps=2)
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    ids, mask, labels = hf_models.batch()
    for step in range(2):
        # The delayed step: the second gradient is taken at the initial weights.
        for part in zip(*(t.tensor_split(3) for t in (ids, mask, labels))):
            ref(**dict(zip(("input_ids", "attention_mask", "labels"), part))).loss.backward()
        if step == 0:
            grads = [p.grad.clone() for p in ref.parameters() if p.requires_grad]
            opt.zero_grad()
            continue
        with torch.no_grad():
            for p, g in zip([p for p in ref.parameters() if p.requires_grad], grads):
                p.sub_(0.1 * g)
                p.sub_(0.1 * p.grad)
    for (name, p), (_, q) in zip(lora.named_parameters(), ref.named_parameters()):
        if p.requires_grad:
            assert "lora_" in name
            assert not torch.equal(p, frozen.get(name, torch.empty(0)))
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), name
        else:
            assert torch.equal(p, frozen[name]), f"frozen {name} changed"


def test_forward_keywords_and_outputs():
    hf = hf_models.model("llama")
    model = wrap_model_to_roundpipe(hf, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    ids, mask, labels = hf_models.batch()
    with torch.no_grad():
        plain = model(input_ids=ids)
        assert plain.loss is None and plain.logits.shape == (4, 20, hf_models.VOCAB)
        assert torch.equal(plain.logits, hf(input_ids=ids).logits)
        with_labels = model(input_ids=ids, labels=labels)
        assert with_labels.logits is None  # not materialized unless asked
        positions = torch.arange(20).unsqueeze(0) + 3
        shifted = model(input_ids=ids, position_ids=positions, attention_mask=mask)
        want = hf(input_ids=ids, position_ids=positions, attention_mask=mask).logits
        assert torch.allclose(shifted.logits, want, rtol=1e-5, atol=1e-6)
        last = model(input_ids=ids, logits_to_keep=1)
        assert last.logits.shape == (4, 1, hf_models.VOCAB)
        assert torch.allclose(last.logits, plain.logits[:, -1:], rtol=1e-5, atol=1e-6)
        # shift_labels: the labels already aligned with the positions.
        aligned = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        assert torch.allclose(model(input_ids=ids, shift_labels=aligned).loss, with_labels.loss, rtol=1e-6)


@pytest.mark.parametrize("kwargs, exc, pattern", [
    ({"input_ids": None}, ValueError, "exactly one of input_ids and inputs_embeds"),
    ({"use_cache": True}, ValueError, "no key/value cache"),
    ({"output_attentions": True}, TypeError, "unexpected keyword argument.*output_attentions"),
    ({"logits_to_keep": -1}, ValueError, "logits_to_keep"),
])
def test_bad_forward_keywords_get_clear_errors(kwargs, exc, pattern):
    model = wrap_model_to_roundpipe(hf_models.model("llama"))
    ids, _, _ = hf_models.batch()
    with pytest.raises(exc, match=pattern):
        with torch.no_grad():
            model(**{"input_ids": ids, **kwargs})


def test_packed_mxfp4_experts_are_refused():
    hf = hf_models.model("gpt_oss")
    experts = hf.model.layers[0].mlp.experts
    experts.register_parameter("gate_up_proj_blocks", torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.uint8),
                                                                        requires_grad=False))
    with pytest.raises(ValueError, match="MXFP4.*dequantize=True"):
        wrap_model_to_roundpipe(hf)


def test_models_without_a_preset():
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model = wrap_model_to_roundpipe(seq)
    assert isinstance(model, roundpipe.RoundPipe) and model.model is seq
    small = torch.nn.Linear(3, 3)  # too small to split: one part, whole (roundpipe.auto)
    whole = wrap_model_to_roundpipe(small)
    x = torch.randn(2, 3)
    assert len(whole.parts()) == 1 and torch.allclose(whole(x), torch.nn.functional.linear(x, small.weight, small.bias))
    with pytest.raises(NotImplementedError, match="no preset for Sequential"):
        wrap_model_to_roundpipe(seq, use_sequential_preset=True)
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        wrap_model_to_roundpipe("Qwen/Qwen3-0.6B")
    # AutoRoundPipe(model) is an ordinary class: it always splits the module
    # tree (presets are wrap_model_to_roundpipe's choice).
    hf = hf_models.model("llama")
    ref = copy.deepcopy(hf)
    auto = roundpipe.AutoRoundPipe(hf, optim_dtype=torch.float32)
    assert type(auto) is roundpipe.AutoRoundPipe and auto.config is hf.config and auto.model is hf
    assert "test_hf_wrap.py" in auto.name and len(auto.parts()) > 1
    ids = torch.randint(0, hf.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = auto(input_ids=ids, use_cache=False).logits  # one cache would take every microbatch
        assert torch.allclose(got, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
