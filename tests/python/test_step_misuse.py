"""Mistakes a PyTorch user makes around forward_backward and step are clear
errors or documented behaviours, never silent (docs/python.md, "Mistakes
that are errors"): torch's GradScaler in an asynchronous step, a non-bool
is_async, forward_backward under no_grad, loss.backward() on its result,
a step before any forward_backward."""
import copy
import io
import pickle

import pytest
import torch
from torch import nn

from roundpipe import AutoRoundPipe, GradScaler, OptimizerCtx, RoundPipe
from conftest import classification_data, classifier


def model_and_optimizer():
    model = RoundPipe(classifier())
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt


def ce(out, y):
    return nn.functional.cross_entropy(out, y)


def test_torch_grad_scaler_in_an_asynchronous_step_names_roundpipes():
    model, opt = model_and_optimizer()
    x, y = classification_data(n=12)
    scaler = torch.amp.GradScaler("cpu")
    model.forward_backward((x,), label=y, loss_fn=lambda out, t: scaler.scale(ce(out, t)))
    with pytest.raises(TypeError, match=r"roundpipe\.GradScaler"):
        model.step(lambda: (scaler.step(opt), opt.zero_grad()))

    class Loop:  # reached through an attribute of an object the step function holds
        def __init__(self):
            self.scaler = scaler

        def step_fn(self):
            self.scaler.step(opt)
            opt.zero_grad()

    with pytest.raises(TypeError, match=r"roundpipe\.GradScaler"):
        model.step(Loop().step_fn)
    # Synchronous steps run torch's scaler in order: allowed, and it works.
    model.step(lambda: (scaler.step(opt), opt.zero_grad()), is_async=False)
    scaler.update()
    # roundpipe's own, and a disabled torch scaler (a no-op), are accepted.
    ours, off = GradScaler(), torch.amp.GradScaler("cpu", enabled=False)
    model.forward_backward((x,), label=y, loss_fn=lambda out, t: ours.scale(ce(out, t)))
    model.step(lambda: (ours.step(opt), off.step(opt), opt.zero_grad()))
    ours.update()
    model.synchronize()


def test_is_async_must_be_a_bool():
    model, opt = model_and_optimizer()
    calls = []
    with pytest.raises(TypeError, match="is_async must be a bool, got 'hello'"):
        model.step(lambda *a: calls.append(a), "hello")
    model.step(lambda *a: calls.append(a), False, "hello")  # step_fn's arguments follow is_async
    assert calls == [("hello",)]
    with pytest.raises(TypeError, match="is_async must be a bool"):
        model.step(lambda: None, 1)
    auto = AutoRoundPipe(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), lower_threshold=1)
    with pytest.raises(TypeError, match="is_async must be a bool"):
        auto.step(lambda: None, "hello")


def test_forward_backward_under_no_grad_is_an_error():
    model, _ = model_and_optimizer()
    x, y = classification_data(n=12)
    for context in (torch.no_grad, torch.inference_mode):
        with context(), pytest.raises(RuntimeError, match="grad mode is off"):
            model.forward_backward((x,), label=y, loss_fn=ce)
    model.synchronize()
    assert all(p.grad is None for p in model.parameters())  # nothing ran
    auto = AutoRoundPipe(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), lower_threshold=1)
    with torch.no_grad(), pytest.raises(RuntimeError, match="grad mode is off"):
        auto.forward_backward((x,), label=y, loss_fn=ce)


def test_backward_of_the_returned_loss_says_it_already_ran():
    model, _ = model_and_optimizer()
    x, y = classification_data(n=12)
    loss = model.forward_backward((x,), label=y, loss_fn=ce)
    with pytest.raises(RuntimeError, match="already run the backward pass"):
        loss.backward()
    # Otherwise a plain detached CPU tensor.
    assert not loss.requires_grad and loss.grad_fn is None and loss.device.type == "cpu"
    assert repr(loss).startswith("tensor(") and f"{loss.item():.3f}"
    assert type(loss * 2) is torch.Tensor and type(loss.detach()) is torch.Tensor
    assert type(copy.deepcopy(loss)) is torch.Tensor and torch.equal(copy.deepcopy(loss), loss)
    buffer = io.BytesIO()
    torch.save(loss, buffer)
    buffer.seek(0)
    assert type(torch.load(buffer)) is torch.Tensor
    assert type(pickle.loads(pickle.dumps(loss))) is torch.Tensor
    assert float(loss.numpy()) == loss.item()
    losses, outputs = model.forward_backward((x,), label=y, loss_fn=lambda out, t: [ce(out, t), out.sum()],
                                             return_outputs=True)
    assert outputs.shape == (12, 4)
    for each in losses:
        with pytest.raises(RuntimeError, match="already run the backward pass"):
            each.backward()
    auto = AutoRoundPipe(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), lower_threshold=1)
    with pytest.raises(RuntimeError, match="already run the backward pass"):
        auto.forward_backward((x,), label=y, loss_fn=ce).backward()


def test_a_step_before_any_forward_backward_runs_with_no_gradients():
    """As torch's optimizer.step() without a backward: parameters without
    .grad are skipped (documented on RoundPipe.step)."""
    model, opt = model_and_optimizer()
    before = [p.detach().clone() for p in model.parameters()]
    seen = []
    model.step(lambda: (seen.append([p.grad for p in model.parameters()]), opt.step(), opt.zero_grad()),
               is_async=False)
    assert seen == [[None] * len(before)]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
