"""Models without a preset (roundpipe.auto; docs/hf.md, "Other models"):
the module tree split into pipelined parts by parameter size, against the
unwrapped model: a tiny GPT-2 (tied embeddings stay between the parts) and a
nested model of our own; outputs, losses and every parameter after three
steps, names unchanged."""
import copy
import threading
import warnings

import pytest
import torch
import transformers
from torch import nn

import roundpipe
from roundpipe import AutoRoundPipe, OptimizerCtx, RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe

from models import assert_close


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=320, n_positions=64, n_embd=64, n_layer=3, n_head=4, use_cache=False,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=0,
                                  bos_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).float()


def train_both(model, net, ref, kwargs_of, steps=3, lr=0.1):
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in range(steps):
        loss, ref_loss = kwargs_of(step, model, ref)
        assert_close(loss, ref_loss, rtol=1e-5, what=f"loss of step {step}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.step(lambda: (opt.step(), opt.zero_grad()))
        ref_opt.step()
        ref_opt.zero_grad()
    model.synchronize()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6, what=name)


def test_a_model_without_a_preset_is_split_into_parts_and_trains_as_itself(tmp_path):
    hf = gpt2()
    ref = copy.deepcopy(hf)
    keys = list(hf.state_dict())
    # 20 kB: the blocks (~200 kB) are parts, the position embedding (16 kB)
    # is not; the tied token embedding / head stays between the parts.
    model = wrap_model_to_roundpipe(hf, use_sequential_preset=False, lower_threshold=20_000,
                                    model_run_config=RoundPipeRunConfig(num_microbatch=2))
    assert isinstance(model, AutoRoundPipe) and isinstance(model, nn.Module)
    assert model._part_paths == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert all(isinstance(p, roundpipe.RoundPipe) for p in model.parts())
    assert list(hf.state_dict()) == keys and model.config is hf.config
    ids = torch.randint(0, 320, (6, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
    n = torch.tensor(6 * 15)

    def losses(step, model, ref):
        loss = model.forward_backward(input_kwargs={"input_ids": ids, "labels": ids, "num_items_in_batch": n},
                                      loss_fn=lambda out, _: out.loss)
        ref_loss = ref(input_ids=ids, labels=ids, num_items_in_batch=n).loss
        ref_loss.backward()
        return loss, ref_loss.detach()

    train_both(model, hf, ref, losses)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, hf.state_dict()[name]), name


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x, scale=1.0):
        return x + scale * self.down(torch.tanh(self.up(x)))


class Nested(nn.Module):
    """Parts under a ModuleList and a ModuleDict, code between them, and a
    small head that stays on the CPU."""

    def __init__(self, width=16):
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(3)])
        self.branches = nn.ModuleDict({"a": Block(width), "b": Block(width)})
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x, scale=0.5)
        x = self.branches["a"](x) * torch.sigmoid(self.branches["b"](x))
        return self.head(x)


def test_nested_parts_keep_their_places_and_train_as_plain_pytorch():
    torch.manual_seed(2)
    net = Nested()
    ref = copy.deepcopy(net)
    block_bytes = sum(p.numel() * 4 for p in net.blocks[0].parameters())
    model = AutoRoundPipe(net, lower_threshold=block_bytes, upper_threshold=block_bytes,
                          model_run_config=RoundPipeRunConfig(num_microbatch=3))
    assert model._part_paths == ["blocks.0", "blocks.1", "blocks.2", "branches.a", "branches.b"]
    names = [n for n, _ in model.optim_named_parameters()]
    assert names == ["model." + n for n, _ in net.named_parameters()]  # the head trains in place
    x, y = torch.randn(9, 16), torch.randn(9, 2)

    def losses(step, model, ref):
        loss_fn = lambda out, t: nn.functional.mse_loss(out, t, reduction="sum")  # noqa: E731
        loss, out = model.forward_backward((x,), label=y, loss_fn=loss_fn, return_outputs=True)
        assert out.shape == (9, 2)
        # The batch split as the model splits it: the same sums of
        # microbatch gradients, not a full-batch gradient rounded otherwise.
        ref_loss = 0
        for xs, ys in zip(x.chunk(3), y.chunk(3)):
            part = loss_fn(ref(xs), ys)
            part.backward()
            ref_loss = ref_loss + part.detach()
        return loss, ref_loss

    train_both(model, net, ref, losses)


def test_asynchronous_steps_have_the_one_step_delay():
    """One step_fn for all parts, run on the first part's optimizer thread:
    call k's gradient is taken before step k - 1 is applied, as RoundPipe's."""
    torch.manual_seed(3)
    net = Nested()
    ref = copy.deepcopy(net)
    model = AutoRoundPipe(net, lower_threshold=1, upper_threshold=5000,
                          model_run_config=RoundPipeRunConfig(num_microbatch=3))
    assert not model._trained_in_place()  # the head is a part too
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(9, 16), torch.randn(9, 2)
    loss_fn = lambda out, t: nn.functional.mse_loss(out, t, reduction="sum")  # noqa: E731
    threads, pending = [], None
    for step in range(3):
        loss = model.forward_backward((x,), label=y, loss_fn=loss_fn)
        ref_loss = sum(loss_fn(ref(xs), ys) for xs, ys in zip(x.chunk(3), y.chunk(3)))
        assert_close(loss, ref_loss.detach(), rtol=1e-5, what=f"loss of call {step}")
        grads = torch.autograd.grad(ref_loss, list(ref.parameters()))
        if pending is not None:
            with torch.no_grad():
                for p, g in zip(ref.parameters(), pending):
                    p.sub_(0.1 * g)
        pending = grads
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning: the step is asynchronous
            model.step(lambda: (threads.append(threading.current_thread()), opt.step(), opt.zero_grad()))
    model.synchronize()
    with torch.no_grad():
        for p, g in zip(ref.parameters(), pending):
            p.sub_(0.1 * g)
    assert len(threads) == 3 and threading.main_thread() not in threads
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6, what=name)


def test_a_failing_asynchronous_step_is_raised_by_the_next_call():
    model = AutoRoundPipe(Nested(), lower_threshold=1, upper_threshold=5000)
    x = torch.randn(4, 16)
    model.forward_backward((x,), loss_fn=lambda out, _: out.sum())
    model.step(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model.synchronize()
    model.synchronize()  # reported once; the model goes on
    model.forward_backward((x,), loss_fn=lambda out, _: out.sum())
    model.step(lambda: None)
    model.synchronize()


def test_set_original_model_redirects_attribute_reads():
    model = AutoRoundPipe(Nested(), lower_threshold=1, upper_threshold=5000)
    other = nn.Linear(2, 2)
    other.marker = "original"
    model.set_original_model(other)
    assert model.marker == "original"
    model.flag = 3
    assert other.flag == 3


def test_errors_and_the_asynchronous_step_warning():
    assert len(wrap_model_to_roundpipe(Nested(), lower_threshold=10 ** 9).parts()) == 1  # no submodule fits: whole
    model = AutoRoundPipe(Nested(), lower_threshold=1000, upper_threshold=5000)  # the head stays between
    assert model._trained_in_place()
    x = torch.randn(4, 16)
    model.forward_backward((x,), loss_fn=lambda out, _: out.sum())
    with pytest.warns(UserWarning, match="runs synchronously"):
        model.step(lambda: None)
    with pytest.raises(ValueError, match="num_microbatch only"):
        model.forward_backward((x,), run_config=RoundPipeRunConfig(merge_output=False))
    with pytest.raises(TypeError, match="cannot be moved"):
        model.cuda()


# ---- the split and merge are the engine's ----------------------------------

class Echo(nn.Module):
    """Returns its inputs: run by a RoundPipe, its outputs show the engine's
    split (merge_output=False) or merge (inputs already split)."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(1))

    def forward(self, *args, **kwargs):
        return args, kwargs


def assert_same_values(ours, engines, what):
    ours_leaves, ours_spec = torch.utils._pytree.tree_flatten(ours)
    their_leaves, their_spec = torch.utils._pytree.tree_flatten(engines)
    assert ours_spec == their_spec, what
    for i, (a, b) in enumerate(zip(ours_leaves, their_leaves)):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{what} leaf {i}"
        else:
            assert a == b, f"{what} leaf {i}: {a!r} vs {b!r}"


def test_the_automatic_split_is_the_engines():
    from roundpipe.microbatch import _split_auto
    g = torch.Generator().manual_seed(3)
    args = (torch.randn(7, 3, generator=g), torch.tensor(2.5), 5, [torch.arange(14).view(7, 2), "s"])
    # A keyword tensor is split only if its dim 0 is the batch size (7).
    kwargs = {"mask": torch.randn(4, 4, generator=g), "z": torch.randn(7, generator=g), "n": torch.tensor(3)}
    label = {"y": torch.arange(7), "w": 0.5}
    echo = RoundPipe(Echo(), model_run_config=RoundPipeRunConfig(num_microbatch=3, merge_output=False))
    packed = echo(*args, label, **kwargs)  # the label as the last positional arg: split as args are
    inputs, labels = _split_auto(args, kwargs, label, 3)
    assert len(inputs) == len(labels) == 3
    for m in range(3):
        engines = torch.utils._pytree.tree_map(lambda mv: mv[m], packed,
                                               is_leaf=lambda v: isinstance(v, roundpipe._C.MicrobatchValues))
        assert_same_values(((*inputs[m][0], labels[m]), inputs[m][1]), engines, f"microbatch {m}")
    with pytest.warns(UserWarning, match="larger than the batch size 7; using 7"):
        assert len(_split_auto(args, kwargs, label, 9)[0]) == 7


def test_the_automatic_merge_is_the_engines():
    from roundpipe.microbatch import _merge_auto

    def engine_merge(outputs):
        echo = RoundPipe(Echo(), model_run_config=RoundPipeRunConfig(
            num_microbatch=len(outputs), split_input=lambda args, kwargs, n: ([(o,) for o in outputs], [{}] * n)))
        return echo()[0][0]

    def outputs(count):
        return [{"logits": torch.full((2, 3), float(m)), "loss": torch.tensor(m + 0.5), "count": count(m),
                 "tag": "same", "pair": (torch.ones(1, dtype=torch.int64) * m, None)} for m in range(3)]

    # Floating scalars are averaged; integer scalars (here equal) kept.
    agreeing = outputs(lambda m: torch.tensor(4))
    merged = _merge_auto(agreeing)
    assert merged["loss"] == torch.tensor(1.5) and merged["count"].dtype == torch.int64
    assert_same_values(merged, engine_merge(agreeing), "merged")
    # Integer scalars that differ are an error, as other values are.
    for differing in (outputs(lambda m: torch.tensor(m)), outputs(lambda m: "x" * m)):
        with pytest.raises(ValueError, match="microbatch 0 and microbatch 1 returned different values"):
            engine_merge(differing)
        with pytest.raises(ValueError, match="microbatch 0 and microbatch 1 returned different values"):
            _merge_auto(differing)


# ---- the batch size of packed (merge_output=False) inputs ------------------

class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h, scale, shift):
        return self.lin(h) * scale + shift


def test_a_replicated_keyword_is_not_split_when_the_positional_inputs_are_packed():
    """The batch size of packed inputs is the rows they were split from (6):
    ``scale`` (4 rows) is replicated, ``shift`` (6 rows) is split."""
    torch.manual_seed(4)
    first, second = nn.Sequential(nn.Linear(4, 4)), Scaled()
    ref_first, ref_second = copy.deepcopy(first), copy.deepcopy(second)
    x, scale, shift = torch.randn(6, 4), torch.randn(4), torch.randn(6, 4)
    ref_out = ref_second(ref_first(x), scale, shift)
    ref_out.square().sum().backward()
    a = RoundPipe(first, model_run_config=RoundPipeRunConfig(num_microbatch=2, merge_output=False))

    b = RoundPipe(second, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    out = b(a(x), scale=scale, shift=shift)
    assert_close(out, ref_out.detach(), what="RoundPipe output")
    out.square().sum().backward()
    a.synchronize()
    b.synchronize()
    for p, q in zip([*first.parameters(), *second.parameters()], [*ref_first.parameters(), *ref_second.parameters()]):
        assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, what="gradient")

    loss = b.forward_backward((a(x),), {"scale": scale, "shift": shift}, loss_fn=lambda out, _: out.square().sum())
    assert_close(loss, ref_out.square().sum().detach(), what="forward_backward loss")

    auto = AutoRoundPipe(Scaled(), model_run_config=RoundPipeRunConfig(num_microbatch=2))
    auto.load_state_dict(second.state_dict())
    loss, merged = auto.forward_backward((a(x),), {"scale": scale, "shift": shift},
                                         loss_fn=lambda out, _: out.square().sum(), return_outputs=True)
    assert_close(merged, ref_out.detach(), what="AutoRoundPipe output")
    assert_close(loss, ref_out.square().sum().detach(), what="AutoRoundPipe loss")


# ---- a batch smaller than the microbatch count; generation after wrapping ---

def test_a_small_batch_is_warned_once_per_model_in_python(capfd):
    """Batch 2, default 3 microbatches (cpu:2): one Python warning per model,
    however many calls and parts, and nothing from the engine on stderr (the
    parts of an AutoRoundPipe do not split their microbatch again)."""
    x, y = torch.randn(2, 16), torch.randn(2, 2)
    loss_fn = lambda out, t: nn.functional.mse_loss(out, t)  # noqa: E731
    models = [AutoRoundPipe(Nested(), lower_threshold=1, upper_threshold=5000),
              RoundPipe(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)))]
    for model in models:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                model.forward_backward((x,), label=y, loss_fn=loss_fn)
                with torch.no_grad():
                    model(x)
        said = [w for w in caught if "larger than the batch size" in str(w.message)]
        assert len(said) == 1, [str(w.message) for w in said]
        assert "num_microbatch 3 is larger than the batch size 2; using 2" in str(said[0].message)
        assert said[0].filename == __file__  # points at the caller's line
    assert "larger than the batch size" not in capfd.readouterr().err


def tiny_causal_lm(kind):
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=None)
    config = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[kind](**common)
    torch.manual_seed(5)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


@pytest.mark.parametrize("kind,preset", [("mistral", None), ("llama", None), ("llama", False)])
def test_generate_and_cached_calls_work_for_batches_after_wrapping(kind, preset):
    """The loaded model's generate (batch 3) after wrapping equals the
    unwrapped model's, on the preset and the split path; so does the
    wrapper's own call with the config's use_cache=True on the split path."""
    hf = tiny_causal_lm(kind)
    ref = copy.deepcopy(hf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = wrap_model_to_roundpipe(hf, use_sequential_preset=preset, lower_threshold=1000)
    ids = torch.randint(1, 64, (3, 6), generator=torch.Generator().manual_seed(6))
    expected = ref.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(hf.generate(ids, max_new_tokens=4, do_sample=False), expected)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected)
    if isinstance(model, AutoRoundPipe):
        assert len(model.parts()) >= 2 and hf.config.use_cache
        with torch.no_grad():
            assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
        # Trained through the wrapper, the loaded model generates with the new weights.
        with OptimizerCtx():
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
        model.forward_backward(input_kwargs={"input_ids": ids, "labels": ids}, loss_fn=lambda out, _: out.loss)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.step(lambda: (opt.step(), opt.zero_grad()))
        assert not torch.equal(hf.model.layers[0].mlp.up_proj.weight, ref.model.layers[0].mlp.up_proj.weight)
        with torch.no_grad():
            assert_close(hf(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-6)


def test_forward_backward_keeps_no_key_value_cache():
    """A loaded model's config says use_cache=True: forward_backward trains
    without a cache (a part's recomputation would extend it again)."""
    import hf_tiny
    hf = hf_tiny.tiny_model("mistral")
    ref = copy.deepcopy(hf)
    assert hf.config.use_cache
    model = AutoRoundPipe(hf, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    ids = torch.randint(0, hf_tiny.VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))
    loss = model.forward_backward(input_kwargs={"input_ids": ids, "labels": ids}, loss_fn=lambda out, _: out.loss)
    model.synchronize()
    ref_loss = sum(ref(input_ids=part, labels=part).loss for part in ids.chunk(2))
    ref_loss.backward()
    assert_close(loss, ref_loss.detach(), rtol=1e-5, what="loss")
    for (name, p), q in zip(hf.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, what=name)
