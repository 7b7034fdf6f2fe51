"""RoundPipe equals plain PyTorch doing the same math: losses,
gradients, buffers and parameters after several steps, with user-defined
Python layers passing tuples and dicts, buffers updated in forward and a
parameter tied across layers."""
import copy

import pytest
import torch

import roundpipe
from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from models import assert_close, mse_loss_fn, reference_forward_backward, value_model

M = 3  # microbatches


def data(step, n=12, width=8, n_out=3):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, width, generator=g), torch.randn(n, n_out, generator=g)


def make_pair():
    net = value_model()
    ref = copy.deepcopy(net)
    return RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=M)), net, ref


def compare_models(net, ref, what):
    for (name, a), (_, b) in zip(net.state_dict().items(), ref.state_dict().items()):
        if a.is_floating_point():
            assert_close(a, b, what=f"{what} {name}")
        else:
            assert torch.equal(a, b), f"{what} {name}: {a} != {b}"


def test_tied_parameter_appears_once():
    model, net, _ = make_pair()
    names = [n for n, _ in model.optim_named_parameters()]
    assert len(names) == len(list(net.parameters()))
    assert "model.0.shared.weight" in names and "model.4.shared.weight" not in names
    assert len(list(model.optim_named_parameters(remove_duplicate=False))) == len(names) + 2


def test_gradients_and_outputs_match_one_call():
    model, net, ref = make_pair()
    x, y = data(0)
    loss, outputs = model.forward_backward((x,), label=y, loss_fn=mse_loss_fn(M), return_outputs=True)
    ref_loss, ref_out = reference_forward_backward(ref, (x,), y, mse_loss_fn(M), M)
    assert_close(loss, ref_loss, what="loss")
    assert_close(outputs, ref_out, what="outputs")
    model.synchronize()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, what=f"grad {name}")
    compare_models(net, ref, "buffers")
    assert int(net[0].calls) == M


@pytest.mark.parametrize("optimizer", ["torch", "roundpipe"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_sync_training_matches_plain_pytorch(optimizer, accumulate):
    model, net, ref = make_pair()
    opt_cls = torch.optim.Adam if optimizer == "torch" else roundpipe.optim.Adam
    with OptimizerCtx():
        opt = opt_cls(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)

    def step_fn():
        opt.step()
        opt.zero_grad()

    for step in range(5):
        for a in range(accumulate):
            x, y = data(step * accumulate + a)
            loss = model.forward_backward((x,), label=y, loss_fn=mse_loss_fn(M))
            ref_loss, _ = reference_forward_backward(ref, (x,), y, mse_loss_fn(M), M)
            assert_close(loss, ref_loss, what=f"loss {step}")
        model.step(step_fn, is_async=False)
        ref_opt.step()
        ref_opt.zero_grad()
        compare_models(net, ref, f"after step {step}")


def test_forward_then_backward_matches():
    model, net, ref = make_pair()
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = data(step)
        out = model(x)
        loss = torch.nn.functional.mse_loss(out, y)
        loss.backward()
        ref_out = torch.cat([ref(xm) for xm in torch.tensor_split(x, M)])
        ref_loss = torch.nn.functional.mse_loss(ref_out, y)
        ref_loss.backward()
        assert_close(loss, ref_loss, what="loss")
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        ref_opt.step()
        ref_opt.zero_grad()
        compare_models(net, ref, f"after step {step}")


def test_input_requiring_grad_gets_its_grad():
    model, net, ref = make_pair()
    x, y = data(0)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    model.forward_backward((x1,), label=y, loss_fn=mse_loss_fn(M))
    reference_forward_backward(ref, (x2,), y, mse_loss_fn(M), M)
    assert x1.grad is not None
    assert_close(x1.grad, x2.grad, what="input grad")


def test_no_grad_forward_and_eval():
    model, net, ref = make_pair()
    x, _ = data(0)
    model.eval()
    ref.eval()
    with torch.no_grad():
        out = model(x)
        ref_out = torch.cat([ref(xm) for xm in torch.tensor_split(x, M)])
    assert not out.requires_grad
    assert_close(out, ref_out, what="eval outputs")
    assert not net.training and not net[1].training
    model.train()
    assert net[1].training


def test_load_state_dict_refreshes_optimizer_copies():
    model, net, _ = make_pair()
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
    target = value_model().state_dict()
    model.load_state_dict(target)
    x, y = data(0)
    model.forward_backward((x,), label=y, loss_fn=mse_loss_fn(M))
    model.step(lambda: opt.step(), is_async=False)  # lr 0: the copies are written back unchanged
    for name, t in target.items():
        if t.is_floating_point() and "running" not in name:
            assert_close(net.state_dict()[name], t, what=name)


def test_parameters_redirect_and_attribute_fallthrough():
    model, net, _ = make_pair()
    masters = list(model.parameters())
    assert all(a is b for a, b in zip(masters, net.parameters()))
    with OptimizerCtx():
        copies = list(model.parameters())
    assert len(copies) == len(masters) and all(c is not m for c, m in zip(copies, masters))
    seen = []
    model.step(lambda: seen.append([p for _, p in model.named_parameters()]), is_async=False)
    assert all(a is b for a, b in zip(seen[0], copies))
    model.some_flag = 3
    assert net.some_flag == 3 and model.some_flag == 3
    del model.some_flag
    assert not hasattr(net, "some_flag")


class ShiftInPlace(torch.nn.Module):
    """Changes its input in place, then squares it."""

    def forward(self, x):
        x.add_(1.0)
        return x * x


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_layers_that_change_their_input_in_place_match(grain):
    # Stages begin at the in-place layers (1, 3, 5): in forward stages, the
    # fused stage and backward stages.
    torch.manual_seed(2)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), ShiftInPlace(), torch.nn.Linear(8, 8), ShiftInPlace(),
                              torch.nn.Linear(8, 8), torch.nn.ReLU(inplace=True), torch.nn.Linear(8, 3))
    ref = copy.deepcopy(net)
    plan = roundpipe.ModelExecutePlan(fwd_plan=[range(0, 3), range(3, 5)],
                                      bwd_plan=[range(5, 7), range(3, 5), range(1, 3), range(0, 1)])
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=M, execute_plan=plan,
                                                               recompute_grain=grain))
    x, y = data(1)
    loss = model.forward_backward((x,), label=y, loss_fn=mse_loss_fn(M))
    ref_loss, _ = reference_forward_backward(ref, (x,), y, mse_loss_fn(M), M)
    assert_close(loss, ref_loss, what="loss")
    model.synchronize()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, what=f"grad {name}")
