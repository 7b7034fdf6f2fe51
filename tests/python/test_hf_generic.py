"""The generic decoder preset (roundpipe.hf_generic, docs/hf.md "Other
decoders") against transformers, on tiny random models of every
architecture in hf_tiny.ARCHITECTURES, in processes with 1 and 3 CPU
devices: the logits and loss with left padding, the load-balancing loss of
the MoE architectures, every gradient and every parameter after three
synchronous steps against plain training, three asynchronous steps against
the one-step-delayed reference, packed sequences (position_ids restarting
inside a row), PEFT LoRA, all fp32 to 1e-5 relative; and the loss in bf16."""
import textwrap
import warnings

import pytest
import torch

import roundpipe
from roundpipe import RoundPipe, wrap_model_to_roundpipe
from roundpipe.auto import WrapPathWarning

import hf_tiny
from device_reports import device_reports

TOLERANCE = 1e-5
BF16_TOLERANCE = 2e-2

SCRIPT = textwrap.dedent('''
    import copy, json, sys, warnings, torch
    sys.path.insert(0, {tests!r})
    import hf_tiny
    from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig, get_num_devices, wrap_model_to_roundpipe
    torch.set_num_threads(1)
    LR = 0.05

    def rel(a, b):
        a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    def model(model_type, dtype=torch.float32):
        hf = hf_tiny.tiny_model(model_type, dtype=dtype)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():  # every weight non-zero: a gradient that does not flow shows
            for p in hf.parameters():
                if not p.abs().sum():
                    p.copy_((torch.randn(p.shape, generator=g) * 0.1).to(p.dtype))
        return hf

    def wrap(hf, m=3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = wrap_model_to_roundpipe(hf, model_run_config=RoundPipeRunConfig(num_microbatch=m))
        said = [str(w.message) for w in caught if type(w.message).__name__ == "WrapPathWarning"]
        assert isinstance(model, RoundPipe) and said and "generic decoder preset" in said[0], said
        return model

    def batch(seed=1, rows=3, length=12):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, hf_tiny.VOCAB, (rows, length), generator=g)
        mask = torch.ones(rows, length, dtype=torch.long)
        mask[1, :4] = 0
        mask[2, :7] = 0
        return ids, mask, ids.masked_fill(mask == 0, -100)

    def microbatch_grads(ref, kwargs, parts=3):
        """The loop that defines forward_backward, through transformers."""
        total = 0.0
        split = {{k: v.tensor_split(parts) if torch.is_tensor(v) and v.dim() == 2 else [v] * parts
                 for k, v in kwargs.items()}}
        for i in range(parts):
            loss = ref(**{{k: v[i] for k, v in split.items()}}).loss
            loss.backward()
            total = total + loss.detach()
        return total

    def sgd(module):
        with torch.no_grad():
            for p in module.parameters():
                if p.grad is not None:
                    p.sub_(LR * p.grad)
                    p.grad = None

    def check(model_type):
        worst = {{}}
        moe = bool(getattr(hf_tiny.tiny_config(model_type), "output_router_logits", False))
        off = {{"output_router_logits": False}} if moe else {{}}
        ids, mask, labels = batch()
        n = (labels[:, 1:] != -100).sum()
        kwargs = {{"input_ids": ids, "attention_mask": mask, "labels": labels, "num_items_in_batch": n}}

        # Synchronous steps against plain training.
        hf, ref = model(model_type), model(model_type)
        net = wrap(hf)
        with torch.no_grad():
            out = net(input_ids=ids, attention_mask=mask, labels=labels, return_logits=True, **off)
            want = ref(input_ids=ids, attention_mask=mask, labels=labels, **off)
        worst["logits"] = rel(out.logits, want.logits)
        worst["loss (mean over the batch)"] = rel(out.loss, want.loss)
        if moe:
            with torch.no_grad():
                one = net(input_ids=ids, attention_mask=mask, labels=labels,
                          roundpipe_run_config=RoundPipeRunConfig(num_microbatch=1))
                want = ref(input_ids=ids, attention_mask=mask, labels=labels)
            worst["aux_loss"] = rel(one.aux_loss, want.aux_loss)
            worst["loss with aux_loss"] = rel(one.loss, want.loss)
        with OptimizerCtx():
            opt = torch.optim.SGD(net.parameters(), lr=LR)
        worst["loss"] = worst["every gradient"] = 0.0
        for _ in range(3):
            loss = net.forward_backward(input_kwargs=kwargs, loss_fn=lambda o, _: o.loss)
            worst["loss"] = max(worst["loss"], rel(loss, microbatch_grads(ref, kwargs)))
            net.synchronize()
            # Relative to each tensor's largest gradient, but at least a
            # thousandth of the model's: a tensor whose gradients nearly
            # vanish (a saturated attention's q/k) holds only rounding noise.
            scale = max(q.grad.abs().max() for q in ref.parameters())
            for p, q in zip(hf.parameters(), ref.parameters()):
                d = ((p.grad - q.grad).abs().max() / torch.maximum(q.grad.abs().max(), 1e-3 * scale)).item()
                worst["every gradient"] = max(worst["every gradient"], d)
            net.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
            sgd(ref)
        worst["parameters after 3 steps"] = max(rel(p, q) for p, q in zip(hf.parameters(), ref.parameters()))

        # Asynchronous steps against the one-step-delayed reference: call k's
        # gradient is taken before step k - 1 is applied.
        hf, ref = model(model_type), model(model_type)
        net = wrap(hf)
        with OptimizerCtx():
            opt = torch.optim.SGD(net.parameters(), lr=LR)
        worst["async loss"] = 0.0
        pending = None
        for _ in range(3):
            loss = net.forward_backward(input_kwargs=kwargs, loss_fn=lambda o, _: o.loss)
            worst["async loss"] = max(worst["async loss"], rel(loss, microbatch_grads(ref, kwargs)))
            grads = [p.grad for p in ref.parameters()]
            for p in ref.parameters():
                p.grad = None
            if pending is not None:
                for p, g in zip(ref.parameters(), pending):
                    p.grad = g
                sgd(ref)
            pending = grads
            net.step(lambda: (opt.step(), opt.zero_grad()), is_async=True)
        for p, g in zip(ref.parameters(), pending):
            p.grad = g
        sgd(ref)
        net.synchronize()
        worst["async parameters after 3 steps"] = max(rel(p, q) for p, q in zip(hf.parameters(), ref.parameters()))

        # Packed sequences: position_ids restart inside a row, no mask. The
        # reference without a cache, as in training: transformers looks for
        # packed sequences only then.
        hf, ref = model(model_type), model(model_type)
        net = wrap(hf, m=2)
        packed_ids = ids[:2]
        positions = torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0).repeat(2, 1)
        packed = {{"input_ids": packed_ids, "position_ids": positions, "labels": packed_ids}}
        loss = net.forward_backward(input_kwargs=packed, loss_fn=lambda o, _: o.loss)
        ref_loss = microbatch_grads(ref, {{**packed, "use_cache": False}}, parts=2)
        net.synchronize()
        worst["packed loss"] = rel(loss, ref_loss)
        worst["packed gradients"] = max(rel(p.grad, q.grad) for p, q in zip(hf.parameters(), ref.parameters()))

        # PEFT LoRA: only the adapters train, as PEFT trains them.
        import peft
        lora_config = dict(r=4, lora_alpha=8, target_modules="all-linear")
        hf = peft.get_peft_model(model(model_type), peft.LoraConfig(**lora_config))
        ref = peft.get_peft_model(model(model_type), peft.LoraConfig(**lora_config))
        with torch.no_grad():
            for p, q in zip(hf.parameters(), ref.parameters()):
                if not p.abs().sum():  # lora_B starts at zero
                    p.normal_(0, 0.05)
                q.copy_(p)
        net = wrap(hf)
        trained = {{n for n, _ in net.optim_named_parameters()}}
        assert trained and all("lora_" in n for n in trained), sorted(trained)[:4]
        with OptimizerCtx():
            opt = torch.optim.SGD(net.parameters(), lr=LR)
        for _ in range(2):
            net.forward_backward(input_kwargs=kwargs, loss_fn=lambda o, _: o.loss)
            microbatch_grads(ref, kwargs)
            net.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
            sgd(ref)
        worst["lora parameters after 2 steps"] = max(rel(p, q) for p, q in zip(hf.parameters(), ref.parameters()))

        # bf16: the loss within bf16's tolerance.
        hf, ref = model(model_type, torch.bfloat16), model(model_type, torch.bfloat16)
        net = wrap(hf, m=1)
        with torch.no_grad():
            got = net(input_ids=ids, attention_mask=mask, labels=labels, **off).loss
            want = ref(input_ids=ids, attention_mask=mask, labels=labels, **off).loss
        bf16 = {{"bf16 loss": rel(got, want)}}
        return worst, bf16

    report = {{"devices": get_num_devices()}}
    for model_type in sys.argv[1:]:
        report[model_type] = check(model_type)
    print(json.dumps(report))
''')


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return device_reports(tmp_path_factory, "hf_generic", SCRIPT, args=list(hf_tiny.ARCHITECTURES))


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("model_type", list(hf_tiny.ARCHITECTURES))
def test_generic_preset_matches_transformers(reports, model_type, devices):
    report = reports[devices]
    assert report["devices"] == devices
    worst, bf16 = report[model_type]
    print(f"{model_type} on {devices} device(s): " + ", ".join(f"{k} {v:.2e}" for k, v in {**worst, **bf16}.items()))
    assert len(worst) >= 10
    bad = {k: v for k, v in worst.items() if not v <= TOLERANCE}
    bad.update({k: v for k, v in bf16.items() if not v <= BF16_TOLERANCE})
    assert not bad, f"{model_type} on {devices} device(s) differs from transformers: {bad}"


# ---------------------------------------------------------------------------
# Which path a model takes (this process's devices).

def _paths(model, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = wrap_model_to_roundpipe(model, **kwargs)
    return wrapped, [str(w.message) for w in caught if issubclass(w.category, WrapPathWarning)]


def test_every_path_is_said_once_with_its_reason():
    wrapped, said = _paths(hf_tiny.tiny_model("mistral"))
    assert isinstance(wrapped, RoundPipe) and len(said) == 1 and "generic decoder preset" in said[0]
    assert len(wrapped.model) == 3 + 2  # embedding | 3 blocks | head
    wrapped, said = _paths(hf_tiny.tiny_model("mistral"), use_sequential_preset=False)
    assert isinstance(wrapped, roundpipe.AutoRoundPipe) and len(said) == 1
    assert "use_sequential_preset=False" in said[0]


def test_a_model_that_is_not_a_decoder_stack_falls_back_with_the_reason():
    import transformers
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32)
    torch.manual_seed(0)
    bert = transformers.BertForMaskedLM(cfg)
    wrapped, said = _paths(bert)
    assert isinstance(wrapped, roundpipe.AutoRoundPipe)
    assert len(said) == 1 and "not a causal language model" in said[0], said
    with pytest.raises(NotImplementedError, match="no preset for BertForMaskedLM: .*not a causal language model"):
        wrap_model_to_roundpipe(bert, use_sequential_preset=True)


def test_an_untested_architecture_is_checked_against_its_own_logits():
    from roundpipe import hf_generic
    hf = hf_tiny.tiny_model("mistral")
    hf.config.model_type = "mistral_variant"  # as an architecture no test covers
    layers = hf_generic.generic_layers(hf)  # the check passes: same logits
    assert len(layers) == 5
    # A causal LM whose forward does more than the layers do is refused.
    original = type(hf).forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        out.logits = out.logits * 2
        return out

    hf.__class__ = type("ScaledMistralForCausalLM", (type(hf),), {"forward": forward})
    with pytest.raises(hf_generic.GenericDecoderUnsupported, match="do not give the model's logits"):
        hf_generic.generic_layers(hf)
    wrapped, said = _paths(hf)
    assert isinstance(wrapped, roundpipe.AutoRoundPipe) and "do not give the model's logits" in said[0]


def test_layers_with_parametrized_weights_take_turns():
    """PEFT's LoRA on parameters (a mixture of experts' stacked weights)
    computes them through torch's parametrize cache, one for the whole
    process: such layers run one at a time (roundpipe._layers), or a device
    could compute with another's parametrized weight and its graph."""
    import peft
    from roundpipe import _layers
    model = peft.get_peft_model(hf_tiny.tiny_model("mixtral"),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    block = model.base_model.model.model.layers[0]
    assert any(type(m).__name__ == "ParamWrapper" for m in block.modules())
    replica = _layers.LayerAdapter(block, 1).make_replica()
    assert replica.turns is _layers._PARAMETRIZE_LOCK
    plain = _layers.LayerAdapter(hf_tiny.tiny_model("mistral").model.layers[0], 1).make_replica()
    assert plain.turns is not _layers._PARAMETRIZE_LOCK


def test_a_parametrize_cache_held_open_by_the_caller_does_not_leak_into_the_layers():
    """The caller's own PEFT model (or any code) inside torch's
    parametrize.cached() switches the process-wide cache on: the layers'
    entries must still not outlive their call (the recomputation would take
    the forward's weight, whose graph is freed)."""
    import peft
    from torch.nn.utils import parametrize
    from roundpipe import OptimizerCtx, RoundPipeRunConfig
    hf = peft.get_peft_model(hf_tiny.tiny_model("mixtral", output_router_logits=False),
                             peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = wrap_model_to_roundpipe(hf, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    with OptimizerCtx():
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
    ids = torch.randint(0, hf_tiny.VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))
    with parametrize.cached():
        for _ in range(2):
            loss = net.forward_backward(input_kwargs={"input_ids": ids, "labels": ids}, loss_fn=lambda o, _: o.loss)
            net.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    assert torch.isfinite(torch.as_tensor(loss))
