"""Iteration overlap from Python: forward_backward returns at its losses and
the results are bitwise those without overlap (seed page's loop)."""
import pytest
import torch
from torch import nn

import roundpipe
from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig


def train(overlap):
    roundpipe.set_overlap_iterations(overlap)
    try:
        torch.manual_seed(0)
        net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.Tanh())], nn.Linear(16, 4))
        model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=3))
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
        return losses, [p.detach().clone() for p in model.parameters()]
    finally:
        roundpipe.set_overlap_iterations(False)


def test_overlap_is_bitwise_the_same_training():
    base_losses, base_params = train(False)
    losses, params = train(True)
    assert losses == base_losses
    for p, q in zip(params, base_params):
        assert torch.equal(p, q)


def test_the_setting_is_checked_and_read_back():
    assert roundpipe.get_overlap_iterations() is False
    with pytest.raises(TypeError, match="must be a bool"):
        roundpipe.set_overlap_iterations(1)
    roundpipe.set_overlap_iterations(True)
    assert roundpipe.get_overlap_iterations() is True
    roundpipe.set_overlap_iterations(False)
