"""Drop-in compatibility with the reference's API: RoundPipe as an
nn.Module, per-microbatch outputs as lists, TensorChunkSpec splits along other
dims, complex parameters and the other optimizers, GradScaler's getters and
synchronous update, joint plans of chained models."""
import pytest
import torch
from torch import nn

import roundpipe
from roundpipe import GradScaler, ModelExecutePlan, OptimizerCtx, RoundPipe, RoundPipeRunConfig
from roundpipe.microbatch import TensorChunkSpec

from models import assert_close, value_model


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


# ---- RoundPipe is an nn.Module ----------------------------------------------

def test_roundpipe_is_a_module_and_can_be_a_submodule():
    net = small()
    model = RoundPipe(net)
    assert isinstance(model, nn.Module)
    assert [n for n, _ in model.named_parameters()] == ["model." + n for n, _ in net.named_parameters()]
    assert list(model.state_dict()) == ["model." + k for k in net.state_dict()]
    assert [n for n, _ in model.optim_named_parameters()] == ["model." + n for n, _ in net.named_parameters()]

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model
            self.scale = nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            return self.body(x) * self.scale

    outer = Outer()
    assert {id(p) for p in outer.parameters()} == {id(p) for p in net.parameters()} | {id(outer.scale)}
    x = torch.randn(6, 4)
    assert_close(outer(x), net(x) * 2.0)
    outer.eval()
    assert not model.training and not net[0].training
    outer.train()
    assert model.training and net[0].training


def test_forward_hooks_run_around_the_pipelined_call():
    model = RoundPipe(small())
    seen = []
    pre = model.register_forward_pre_hook(lambda m, args: seen.append(("pre", args[0].shape)))
    post = model.register_forward_hook(lambda m, args, out: seen.append(("post", out.shape)) or out * 0)
    out = model(torch.randn(6, 4))
    assert seen == [("pre", (6, 4)), ("post", (6, 2))] and not out.abs().sum()
    pre.remove()
    post.remove()
    assert model(torch.randn(6, 4)).abs().sum()


def test_state_dict_round_trip_takes_both_key_sets():
    net, other = small(), small()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    model = RoundPipe(net)
    model.load_state_dict(RoundPipe(other).state_dict())  # "model." keys
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), other.parameters()))
    model.load_state_dict(small().state_dict())  # the wrapped model's keys
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), small().parameters()))
    with pytest.raises(ValueError, match="assign=True"):
        model.load_state_dict(small().state_dict(), assign=True)


def test_dtype_conversions_rebuild_and_device_moves_are_refused():
    net = small()
    model = RoundPipe(net)
    assert model.double() is model and net[0].weight.dtype == torch.float64
    assert model(torch.randn(3, 4, dtype=torch.float64)).dtype == torch.float64
    assert model.float() is model and net[0].weight.dtype == torch.float32
    assert model.cpu() is model
    with pytest.raises(ValueError, match="keeps the model on the CPU"):
        model.cuda()
    with pytest.raises(TypeError, match="cannot be moved or converted tensor by tensor"):
        model._apply(lambda t: t)


# ---- outputs of merge_output=False -------------------------------------------

def test_unmerged_outputs_index_iterate_and_synchronize_like_lists():
    net = small()
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=3, merge_output=False))
    x = torch.randn(6, 4)
    with torch.no_grad():
        out = model(x)
        want = [net(part) for part in x.tensor_split(3)]
    assert out.synchronize() is out and len(out) == 3
    for got, expected in zip(out, want):
        assert_close(got, expected)
    assert_close(out[-1], want[-1])
    assert len(out[1:]) == 2
    with pytest.raises(IndexError):
        out[3]


# ---- TensorChunkSpec along another dim ---------------------------------------

def test_tensor_chunk_spec_on_dim_1_takes_the_batch_size_from_dim_1(capfd):
    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x):  # x: [T, B, 4]
            return self.lin(x).transpose(0, 1)

    torch.manual_seed(0)
    net = Transposed()
    spec = RoundPipeRunConfig(num_microbatch=3, split_input=((TensorChunkSpec(1),), None))
    model = RoundPipe(net, model_run_config=spec)
    x = torch.randn(2, 6, 4)  # dim 0 (2) is smaller than the 3 microbatches
    with torch.no_grad():
        assert_close(model(x), net(x).reshape(6, 2, 2))
    narrow = torch.randn(5, 2, 4)  # 2 rows along dim 1: 2 microbatches, with a warning
    with torch.no_grad():
        assert_close(model(narrow), net(narrow).reshape(2, 5, 2))
    assert "num_microbatch 3 is larger than the batch size 2" in capfd.readouterr().err


# ---- optimizers ----------------------------------------------------------------

@pytest.mark.parametrize("name, kwargs", [
    ("Adam", {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}),
    ("AdamW", {"lr": 1e-2}),
    ("SGD", {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
])
def test_complex_parameters_update_as_torch_optim_does(name, kwargs):
    g = torch.Generator().manual_seed(0)
    start = torch.randn(33, dtype=torch.complex64, generator=g)
    ours, theirs = start.clone().requires_grad_(), start.clone().requires_grad_()
    opt = getattr(roundpipe.optim, name)([ours], **kwargs)
    ref = getattr(torch.optim, name)([theirs], foreach=False, **kwargs)
    for _ in range(10):
        grad = torch.randn(33, dtype=torch.complex64, generator=g)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    assert_close(ours.detach(), theirs.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["Adadelta", "Adafactor", "Adagrad", "Adamax", "ASGD", "NAdam", "RAdam",
                                  "RMSprop", "Rprop"])
def test_the_other_optimizers_train_roundpipe_copies(name):
    net = small()
    model = RoundPipe(net)
    with OptimizerCtx():
        opt = getattr(roundpipe.optim, name)(model.parameters(), lr=1e-2)
    before = [p.clone() for p in net.parameters()]
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    model.forward_backward((x,), label=y, loss_fn=nn.functional.mse_loss)
    model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
    assert all(not torch.equal(a, b) for a, b in zip(before, net.parameters()))


# ---- GradScaler ----------------------------------------------------------------

def test_grad_scaler_getters_and_synchronous_update_as_torch():
    scaler = GradScaler(init_scale=8.0, growth_interval=1, backoff_factor=0.25)
    assert scaler.get_backoff_factor(up_to_date=True) == 0.25
    assert scaler.get_growth_interval(up_to_date=True) == 1
    assert scaler.get_growth_factor(up_to_date=True) == 2.0
    model = RoundPipe(small())
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    for expected in (16.0, 32.0):
        model.forward_backward((x,), label=y, loss_fn=lambda o, t: scaler.scale(nn.functional.mse_loss(o, t)))
        model.step(lambda: (scaler.step(opt), opt.zero_grad()), is_async=False)
        scaler.update(is_async=False)
        assert scaler.get_scale() == expected  # the new scale, as torch's GradScaler


# ---- joint plans ---------------------------------------------------------------

def test_joint_fused_plans_give_the_models_before_the_last_a_train_plan():
    first = RoundPipe(value_model(), model_run_config=RoundPipeRunConfig(merge_output=False))
    last = RoundPipe(nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2)))
    plan_first, plan_last = ModelExecutePlan.auto("fused", first, last)
    x, y = torch.randn(6, 8), torch.randn(6, 2)
    # forward rejects fused plans: the first model's must be a train plan.
    hidden = first(x, roundpipe_run_config=RoundPipeRunConfig(execute_plan=plan_first))
    loss = last.forward_backward((hidden,), label=y, loss_fn=nn.functional.mse_loss,
                                 run_config=RoundPipeRunConfig(execute_plan=plan_last))
    assert torch.isfinite(loss)
    with pytest.raises(ValueError):
        last(torch.randn(6, 3), roundpipe_run_config=RoundPipeRunConfig(execute_plan=plan_last))
