"""Frozen weights kept packed (roundpipe.packed; docs/hf.md, "QLoRA"):
dequantization bitwise equal to bitsandbytes' for NF4 and FP4 with double
quantization (both ways: our packing dequantized by bitsandbytes, and
bitsandbytes' packing by us), the int8 format's rounding, and a QLoRA model
through wrap_model_to_roundpipe(frozen_weights=...) or loaded through
bitsandbytes, in processes with 1 and 3 CPU devices: the loss and every
LoRA gradient against the plain PEFT model on the same weights, the LoRA
parameters after two asynchronous steps against the one-step-delayed
reference, and the adapters saved as PEFT saves them."""
import textwrap

import pytest
import torch
from torch import nn

from roundpipe import packed
from roundpipe.packed import PackedLinear, pack_frozen_linears

from device_reports import device_reports

bnb_functional = pytest.importorskip("bitsandbytes.functional")

SHAPES = [(64, 128), (96, 40), (33, 70), (1, 7)]


def frozen_linear(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(shape[1], shape[0]).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(shape, generator=g).to(dtype))
    linear.weight.requires_grad_(False)
    return linear


def test_the_dynamic_map_is_bitsandbytes():
    assert torch.equal(packed.dynamic_code(), bnb_functional.create_dynamic_map())
    for fmt in ("nf4", "fp4"):
        assert torch.equal(packed.four_bit_code(fmt), bnb_functional.get_4bit_type(fmt, device="cpu"))


@pytest.mark.parametrize("fmt", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_dequantization_is_bitwise_bitsandbytes(fmt, dtype, shape):
    linear = frozen_linear(shape, dtype)
    ours = PackedLinear.from_linear(linear, fmt)
    assert ours.packed.dtype == torch.uint8 and ours.packed.numel() == (shape[0] * shape[1] + 1) // 2
    # Our packing, dequantized by bitsandbytes.
    nested = bnb_functional.QuantState(absmax=ours.nested_scales, code=ours.nested_code, blocksize=256,
                                       dtype=torch.float32)
    state = bnb_functional.QuantState(absmax=ours.scales, shape=torch.Size(shape), dtype=dtype, blocksize=64,
                                      quant_type=fmt, code=ours.code, offset=ours.offset, state2=nested)
    weight = ours.dequantized_weight()
    assert weight.dtype == dtype and weight.shape == shape
    assert torch.equal(weight, bnb_functional.dequantize_4bit(ours.packed.reshape(-1, 1), state))
    # bitsandbytes' packing, dequantized by us.
    q, theirs = bnb_functional.quantize_4bit(linear.weight.data, blocksize=64, compress_statistics=True,
                                             quant_type=fmt)
    again = PackedLinear(fmt, shape, dtype, None, packed=q.reshape(-1), scales=theirs.absmax,
                         nested_scales=theirs.state2.absmax, offset=torch.as_tensor(theirs.offset),
                         nested_code=theirs.state2.code, code=theirs.code)
    assert torch.equal(again.dequantized_weight(), bnb_functional.dequantize_4bit(q, theirs))
    # And the forward is F.linear on that weight.
    x = torch.randn(3, shape[1]).to(dtype)
    assert torch.equal(ours(x), nn.functional.linear(x, weight, linear.bias))


def test_int8_rounds_each_row_to_its_scale():
    linear = frozen_linear((16, 48), torch.bfloat16)
    ours = PackedLinear.from_linear(linear, "int8")
    w = linear.weight.float()
    scale = w.abs().amax(dim=1) / 127
    assert ours.packed.dtype == torch.int8 and torch.equal(ours.row_scale, scale)
    assert torch.equal(ours.packed, torch.round(w / scale.unsqueeze(1)).to(torch.int8))
    err = (ours.dequantized_weight().float() - w).abs()
    assert (err <= scale.unsqueeze(1) * 0.5 + w.abs() * 2 ** -8).all()  # half a level, plus bf16 rounding


def test_host_bytes_per_weight():
    net = nn.Sequential(*[frozen_linear((1024, 1024), torch.bfloat16, seed=i) for i in range(2)])
    weights = sum(m.weight.numel() for m in net)
    assert pack_frozen_linears(net, "nf4") == 2
    # 4 bits, an 8-bit maximum per 64, an fp32 one per 256 x 64, the code tables
    assert 0.51 < packed.packed_bytes(net) / weights < 0.52
    net = nn.Sequential(*[frozen_linear((256, 256), torch.bfloat16, seed=i) for i in range(2)])
    pack_frozen_linears(net, "int8")
    assert 1.0 < packed.packed_bytes(net) / (2 * 256 * 256) < 1.02


def test_bad_requests_are_clear_errors():
    trained = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no frozen nn.Linear weight"):
        pack_frozen_linears(trained, "nf4")
    with pytest.raises(ValueError, match="frozen_weights must be one of 'nf4', 'fp4', 'int8'"):
        pack_frozen_linears(trained, "nf5")
    with pytest.raises(ValueError, match="packs frozen weights; this nn.Linear's weight is trained"):
        PackedLinear.from_linear(trained[0], "nf4")
    from roundpipe import wrap_model_to_roundpipe
    with pytest.raises(ValueError, match="no frozen nn.Linear weight"):
        wrap_model_to_roundpipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), frozen_weights="int8")


SCRIPT = textwrap.dedent('''
    import copy, json, sys, tempfile, warnings, torch, peft, transformers
    sys.path.insert(0, {tests!r})
    import hf_tiny
    from roundpipe import OptimizerCtx, RoundPipeRunConfig, get_num_devices, wrap_model_to_roundpipe
    from roundpipe.packed import PackedLinear
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    LR = 0.05

    def rel(a, b):
        a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    def lora(base):
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():  # lora_B starts at zero: give its gradients something to carry
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
        return model

    def reference_of(model):
        """The plain PEFT model on the weights the packed one computes with."""
        ref = copy.deepcopy(model)
        modules = dict(ref.named_modules())
        with torch.no_grad():
            for name, m in model.named_modules():
                if isinstance(m, PackedLinear):
                    plain = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None,
                                            dtype=m.weight_dtype)
                    plain.weight.copy_(m.dequantized_weight())
                    plain.weight.requires_grad_(False)
                    if m.bias is not None:
                        plain.bias = copy.deepcopy(m.bias)
                    parent, _, leaf = name.rpartition(".")
                    setattr(modules[parent], leaf, plain)
        return ref

    def check(model, tag, report, model_type="llama", as_loaded=None):
        net = wrap_model_to_roundpipe(model, frozen_weights="nf4" if tag != "bitsandbytes" else None,
                                      optim_dtype=torch.float32,
                                      model_run_config=RoundPipeRunConfig(num_microbatch=2))
        worst = {{}}
        if as_loaded is not None:  # the loss of the model as bitsandbytes and PEFT compute it
            ids, plain = as_loaded
            with torch.no_grad():
                got = net(input_ids=ids, labels=ids, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=1)).loss
            worst["loss as loaded"] = rel(got, plain)
        packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
        assert len(packed) == 21, len(packed)  # 3 blocks x 7 projections; not the head
        trained = [n for n, _ in net.optim_named_parameters()]
        assert trained and all("lora_" in n for n in trained)
        ref = reference_of(model)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, hf_tiny.VOCAB, (4, 12), generator=g)
        with OptimizerCtx():
            opt = torch.optim.SGD(net.parameters(), lr=LR)
        ref_params = {{n: p for n, p in ref.named_parameters() if p.requires_grad}}
        pending = None
        for step in range(2):
            loss = net.forward_backward(input_kwargs={{"input_ids": ids, "labels": ids}}, loss_fn=lambda o, _: o.loss)
            ref_loss = sum(ref(input_ids=p, labels=p).loss.float() for p in ids.chunk(2))
            ref_loss.backward()
            worst[f"loss {{step}}"] = rel(loss, ref_loss.detach())
            if step == 0:
                net.synchronize()
                worst["every LoRA gradient"] = max(rel(p.grad, ref_params[n].grad)
                                                   for n, p in model.named_parameters() if p.requires_grad)
            grads = {{n: p.grad.clone() for n, p in ref_params.items()}}
            for p in ref_params.values():
                p.grad = None
            if pending is not None:
                with torch.no_grad():
                    for n, p in ref_params.items():
                        p.sub_(LR * pending[n])
            pending = grads
            net.step(lambda: (opt.step(), opt.zero_grad()))
        net.synchronize()
        with torch.no_grad():
            for n, p in ref_params.items():
                p.sub_(LR * pending[n])
        worst["LoRA parameters after 2 asynchronous steps"] = max(
            rel(p, ref_params[n]) for n, p in model.named_parameters() if p.requires_grad)
        out = tempfile.mkdtemp()
        model.save_pretrained(out)
        saved = peft.PeftModel.from_pretrained(hf_tiny.tiny_model(model_type, dtype=torch.bfloat16), out)
        got = {{n: p for n, p in saved.named_parameters() if "lora_" in n}}
        assert got and all(torch.equal(got[n].float(), p.float())
                           for n, p in model.named_parameters() if "lora_" in n), "adapters saved"
        report[tag] = worst

    report = {{"devices": get_num_devices()}}
    for model_type in ("llama", "mistral"):  # a preset and the generic preset
        check(lora(hf_tiny.tiny_model(model_type, dtype=torch.bfloat16)), model_type, report, model_type)
    # A model loaded through bitsandbytes, kept as it was loaded.
    path = tempfile.mkdtemp()
    hf_tiny.tiny_model("llama", dtype=torch.bfloat16).save_pretrained(path)
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config,
                                                               dtype=torch.bfloat16, device_map="cpu")
    model = lora(loaded)
    ids = torch.randint(0, hf_tiny.VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(input_ids=ids, labels=ids).loss
    check(model, "bitsandbytes", report, as_loaded=(ids, plain))
    print(json.dumps(report))
''')


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return device_reports(tmp_path_factory, "packed", SCRIPT)


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("tag", ["llama", "mistral", "bitsandbytes"])
def test_qlora_matches_peft_on_the_same_weights(reports, tag, devices):
    report = reports[devices]
    assert report["devices"] == devices
    worst = report[tag]
    print(f"{tag} on {devices} device(s): " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    bad = {k: v for k, v in worst.items() if not v <= 1e-5}
    assert not bad, bad


def test_bitsandbytes_8bit_weights_are_refused_with_the_way_out():
    import bitsandbytes as bnb
    net = nn.Sequential(bnb.nn.Linear8bitLt(16, 16, has_fp16_weights=False))
    with pytest.raises(ValueError, match="Linear8bitLt \\(bitsandbytes\\) weights cannot be wrapped.*load_in_4bit"):
        pack_frozen_linears(net, None)
