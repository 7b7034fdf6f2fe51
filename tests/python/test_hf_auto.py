"""Models without a preset (roundpipe.auto, SPEC 4.8): the module tree split
into pipelined parts by parameter size, against the unwrapped model: a tiny
GPT-2 (tied embeddings stay between the parts) and a nested model of our own;
outputs, losses and every parameter after three steps, names unchanged."""
import copy
import warnings

import pytest
import torch
import transformers
from torch import nn

import roundpipe
from roundpipe import AutoRoundPipe, OptimizerCtx, RoundPipeRunConfig, wrap_model_to_roundpipe

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
    model = wrap_model_to_roundpipe(hf, lower_threshold=20_000,
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
        # The batch split as the model splits it (SPEC 7): the same sums of
        # microbatch gradients, not a full-batch gradient rounded otherwise.
        ref_loss = 0
        for xs, ys in zip(x.chunk(3), y.chunk(3)):
            part = loss_fn(ref(xs), ys)
            part.backward()
            ref_loss = ref_loss + part.detach()
        return loss, ref_loss

    train_both(model, net, ref, losses)


def test_errors_and_the_asynchronous_step_warning():
    assert len(wrap_model_to_roundpipe(Nested(), lower_threshold=10 ** 9).parts()) == 1  # no submodule fits: whole
    model = AutoRoundPipe(Nested(), lower_threshold=1, upper_threshold=5000)
    x = torch.randn(4, 16)
    model.forward_backward((x,), loss_fn=lambda out, _: out.sum())
    with pytest.warns(UserWarning, match="runs synchronously"):
        model.step(lambda: None)
    with pytest.raises(ValueError, match="num_microbatch only"):
        model.forward_backward((x,), run_config=RoundPipeRunConfig(merge_output=False))
    with pytest.raises(TypeError, match="cannot be moved"):
        model.cuda()
