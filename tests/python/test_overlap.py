"""Iteration overlap from Python: forward_backward returns at its losses (the
default) and the results are bitwise those without overlap (seed page's
loop), also for models with buffers; the options are per model."""
import pytest
import torch
from torch import nn

from models import Counter
from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig


def net(kind):
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(16, 16), nn.Tanh())]
    if kind == "batchnorm":
        layers.insert(1, nn.BatchNorm1d(16))
    elif kind == "counter":
        layers.insert(2, Counter())
    return nn.Sequential(*layers, nn.Linear(16, 4))


def train(kind, overlap):
    model = RoundPipe(net(kind), overlap_iterations=overlap,
                      model_run_config=RoundPipeRunConfig(num_microbatch=3))
    with OptimizerCtx():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.mse_loss)
        losses.append(loss.item())

        def step_fn():
            opt.step()
            opt.zero_grad()
        model.step(step_fn)
    model.synchronize()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", ["plain", "batchnorm", "counter"])
def test_overlap_is_bitwise_the_same_training(kind):
    base_losses, base_state = train(kind, False)
    losses, state = train(kind, True)
    assert losses == base_losses
    assert base_state.keys() == state.keys()
    for k in state:
        assert torch.equal(state[k], base_state[k]), k
    if kind == "counter":
        assert state["model.2.calls"].item() == 6 * 3, "every microbatch of every call counted once"


def test_the_options_are_checked():
    with pytest.raises(TypeError, match="overlap_iterations must be a bool"):
        RoundPipe(net("plain"), overlap_iterations=1)
    with pytest.raises(TypeError, match="sync_warmup_steps must be an int"):
        RoundPipe(net("plain"), sync_warmup_steps="2")
    with pytest.raises(ValueError, match="sync_warmup_steps must be >= 0"):
        RoundPipe(net("plain"), sync_warmup_steps=-1)
