"""The asynchronous step's exact one-step delay (docs/guide.md,
"3. A training loop"), warm-up steps, errors from user code keeping their
Python class (docs/python.md, "How Python code runs"), and the GIL being
released while the engine works."""
import copy
import threading

import pytest
import torch

import roundpipe
from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from models import assert_close, mse_loss_fn, reference_forward_backward, value_model

M = 2


def data(step, n=8, width=8, n_out=3):
    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(n, width, generator=g), torch.randn(n, n_out, generator=g)


def reference_delayed(ref, steps, warmup, lr=1e-2):
    """One-step delay in plain PyTorch: fb after step k sees θ_{k-1}."""
    copies = [p.detach().clone().requires_grad_() for p in ref.parameters()]
    opt = torch.optim.Adam(copies, lr=lr)
    losses = []
    for i in range(steps):
        x, y = data(i)
        loss, _ = reference_forward_backward(ref, (x,), y, mse_loss_fn(M), M)
        losses.append(loss)
        for c, p in zip(copies, ref.parameters()):
            c.grad = p.grad.clone()
            p.grad = None
        k = i + 1
        delayed = k > warmup
        with torch.no_grad():
            if delayed:  # calls after step k see the copies as they were before it
                for c, p in zip(copies, ref.parameters()):
                    p.copy_(c)
            opt.step()
            opt.zero_grad()
            if not delayed:
                for c, p in zip(copies, ref.parameters()):
                    p.copy_(c)
    return losses, copies


@pytest.mark.parametrize("warmup", [0, 2])
def test_async_trajectory_matches_one_step_delay_reference(warmup):
    net = value_model()
    ref = copy.deepcopy(net)
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=M), sync_warmup_steps=warmup)
    with OptimizerCtx():
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for i in range(6):
        x, y = data(i)
        losses.append(model.forward_backward((x,), label=y, loss_fn=mse_loss_fn(M)))
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    ref_losses, ref_copies = reference_delayed(ref, 6, warmup)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close(a, b, what=f"loss {i}")
    for (name, c), r in zip(model.optim_named_parameters(), ref_copies):
        assert_close(c, r.detach(), what=f"optimizer copy {name}")
    for p, r in zip(net.parameters(), ref_copies):  # synchronize: model = latest result
        assert_close(p.detach(), r.detach(), what="model after synchronize")


class UserError(Exception):
    pass


def test_user_exception_in_loss_fn_keeps_its_class():
    model = RoundPipe(value_model(), name="errors-model", model_run_config=RoundPipeRunConfig(num_microbatch=M))
    x, y = data(0)

    def bad_loss(outputs, labels):
        raise UserError("bad loss here")

    with pytest.raises(UserError, match="bad loss here") as info:
        model.forward_backward((x,), label=y, loss_fn=bad_loss)
    message = str(info.value)
    assert "errors-model" in message and "microbatch" in message and "device" in message
    model.synchronize()
    assert all(p.grad is None for p in model.model.parameters())  # nothing half-applied
    loss = model.forward_backward((x,), label=y, loss_fn=mse_loss_fn(M))  # still usable
    assert torch.isfinite(loss)


def test_user_exception_in_layer_and_step_fn_keeps_its_class():
    class Exploding(torch.nn.Module):
        def forward(self, x):
            raise KeyError("layer went wrong")

    model = RoundPipe(torch.nn.Sequential(torch.nn.Linear(8, 8), Exploding()))
    with pytest.raises(KeyError, match="layer went wrong"):
        model(torch.randn(4, 8))

    model = RoundPipe(value_model(), model_run_config=RoundPipeRunConfig(num_microbatch=M))
    x, y = data(0)
    model.forward_backward((x,), label=y, loss_fn=mse_loss_fn(M))

    def bad_step():
        raise UserError("bad step")

    model.step(bad_step)  # asynchronous: raised by a later call (at the latest the next step)
    with pytest.raises(UserError, match="bad step") as info:
        model.forward_backward((x,), label=y, loss_fn=mse_loss_fn(M))
        model.step(lambda: None)
    assert "step 1" in str(info.value)
    model.forward_backward((x,), label=y, loss_fn=mse_loss_fn(M))
    model.step(lambda: None, is_async=False)
    model.synchronize()


def test_bad_arguments_get_clear_errors():
    model = RoundPipe(value_model())
    x, y = data(0)
    with pytest.raises(TypeError, match="input_args must be a tuple"):
        model.forward_backward(x, label=y)
    with pytest.raises(ValueError, match="num_microbatch"):
        RoundPipeRunConfig(num_microbatch=0)
    with pytest.raises(ValueError, match="recompute_grain"):
        RoundPipeRunConfig(recompute_grain="both")
    with pytest.raises(TypeError, match="step_fn must be callable"):
        model.step(3)
    with pytest.raises(ValueError, match="pin_model"):
        RoundPipe(value_model(), pin_model="yes")
    with pytest.raises(ValueError, match="CPU"):
        model.to("meta")


def test_gil_is_released_while_the_engine_works():
    net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=4))
    running = threading.Event()
    stop = threading.Event()
    ticks = []

    def spin():
        while not stop.is_set():
            ticks.append(1)
            running.set()

    x = torch.randn(256, 256)
    thread = threading.Thread(target=spin)
    thread.start()
    running.wait()
    try:
        for _ in range(3):
            before = len(ticks)
            model.forward_backward((x,), label=None, loss_fn=lambda out, _: out.square().mean())
            assert len(ticks) > before
    finally:
        stop.set()
        thread.join()


class FailsWhenRecomputed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        if roundpipe.doing_recompute():
            raise UserError("recompute failed")
        return self.lin(x)


def test_error_during_loss_backward_keeps_its_class():
    net = torch.nn.Sequential(FailsWhenRecomputed(), torch.nn.Linear(8, 1))
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=M))
    plan = roundpipe.ModelExecutePlan([range(0, 1), range(1, 2)], [range(1, 2), range(0, 1)])
    out = model(torch.randn(4, 8), roundpipe_run_config=RoundPipeRunConfig(execute_plan=plan))
    with pytest.raises(UserError, match="recompute failed"):
        out.sum().backward()
    with torch.no_grad():
        assert model(torch.randn(4, 8)).shape == (4, 1)  # still usable


EXIT_AFTER_ERROR = '''
import torch
from torch import nn
from roundpipe import RoundPipe
model = RoundPipe(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)))
try:
    model.forward_backward((torch.randn(6, 5),), label=torch.randn(6, 4), loss_fn=torch.nn.functional.mse_loss)
except RuntimeError:
    pass
print("done")
'''


def test_interpreter_exits_cleanly_after_a_failed_call(tmp_path):
    # A failed call's Python exception could be released by a device worker
    # while the interpreter shut down, which ended the process with
    # std::terminate (it happened in about half of the runs).
    import subprocess
    import sys
    script = tmp_path / "exit.py"
    script.write_text(EXIT_AFTER_ERROR)
    for _ in range(6):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "done" in done.stdout, done.stderr[-2000:]
        assert "terminate" not in done.stderr, done.stderr[-2000:]
