"""GradScaler in the seed page's loop, with inf gradients injected: skipped
steps, the scale trajectory (backoff, growth) and the parameters match a
hand-computed reference, in async and sync mode; real_loss is right."""
import copy
import math
import threading

import pytest
import torch

from roundpipe import GradScaler, OptimizerCtx, RoundPipe, RoundPipeRunConfig
from conftest import classification_data, classifier

M = 2
INIT = 2.0 ** 10
INTERVAL = 3
INF_AT = {2, 3, 7}
STEPS = 10
LR = 0.05


def batch(i):
    x, y = classification_data(n=16, seed=40 + i)
    return x, y


def expected_scales(is_async):
    """S_e (scale of epoch e) under the documented chain."""
    states = [(INIT, 0)]
    scales = [INIT]
    for j in range(STEPS):
        scale, tracker = states[j]
        if j in INF_AT:
            states.append((min(scale, scales[j] * 0.5), 0))
        elif tracker + 1 == INTERVAL:
            states.append((scale * 2.0, 0))
        else:
            states.append((scale, tracker + 1))
        scales.append(states[j if is_async else j + 1][0])
    return scales


def reference_params(net, is_async):
    ref = copy.deepcopy(net)
    copies = [p.detach().clone() for p in ref.parameters()]
    crit = torch.nn.CrossEntropyLoss()
    losses = []
    for i in range(STEPS):
        x, y = batch(i)
        loss_sum = 0.0
        for xm, ym in zip(torch.tensor_split(x, M), torch.tensor_split(y, M)):
            loss = crit(ref(xm), ym) / M
            loss.backward()
            loss_sum += loss.item()
        losses.append(loss_sum)
        grads = [p.grad.clone() for p in ref.parameters()]
        ref.zero_grad()
        with torch.no_grad():
            if is_async:  # calls after this step see the copies from before it
                for c, p in zip(copies, ref.parameters()):
                    p.copy_(c)
            if i not in INF_AT:
                for c, g in zip(copies, grads):
                    c.add_(g, alpha=-LR)
            if not is_async:
                for c, p in zip(copies, ref.parameters()):
                    p.copy_(c)
    return losses, copies


@pytest.mark.parametrize("is_async", [True, False])
def test_seed_loop_with_injected_inf(is_async):
    net = classifier()
    ref_losses, ref_copies = reference_params(net, is_async)
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=M))
    stepped, step_fns = [], []

    class RecordingSGD(torch.optim.SGD):
        def step(self, closure=None):
            stepped.append(len(step_fns) - 1)
            return super().step(closure)

    with OptimizerCtx():
        optimizer = RecordingSGD(model.parameters(), lr=LR)
    scaler = GradScaler(init_scale=INIT, growth_interval=INTERVAL)
    criterion = torch.nn.CrossEntropyLoss()
    scales, real_losses = [], []
    for i in range(STEPS):
        data, labels = batch(i)
        poison = math.inf if i in INF_AT else 1.0
        loss = model.forward_backward(
            input_args=(data,),
            label=labels,
            loss_fn=lambda outputs, labels: scaler.scale(criterion(outputs.float(), labels) * poison) / M,
        )
        model.step(lambda: (step_fns.append(1), scaler.step(optimizer), optimizer.zero_grad()), is_async=is_async)
        used = scaler.get_scale()  # the scale this iteration's losses were scaled with
        scaler.update(is_async=is_async)
        scales.append(scaler.get_scale())
        # Asynchronous: the seed's `loss.item() / scaler.get_scale()` after
        # update() (the main view lags one update). Synchronous: as torch's,
        # get_scale() is the new scale at once.
        real_losses.append(loss.item() / (scaler.get_scale() if is_async else used))
    model.synchronize()
    # S_i for iteration i asynchronously; synchronously the scale after update i.
    assert scales == (expected_scales(True)[:STEPS] if is_async else expected_scales(False)[1:STEPS + 1])
    for i in range(STEPS):
        if i not in INF_AT:
            assert real_losses[i] == pytest.approx(ref_losses[i], rel=1e-5), i
    assert stepped == [i for i in range(STEPS) if i not in INF_AT]
    for p, r in zip(net.parameters(), ref_copies):
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)


def test_update_off_the_main_thread_raises():
    scaler = GradScaler()
    errors = []

    def other():
        try:
            scaler.update()
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and "thread" in errors[0]


def test_disabled_scaler_and_state_dict():
    off = GradScaler(enabled=False)
    x = torch.ones(3)
    assert off.scale(x) is x and off.get_scale() == 1.0 and off.state_dict() == {}
    on = GradScaler(init_scale=8.0, growth_interval=5)
    state = on.state_dict()
    assert set(state) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    assert state["scale"] == 8.0 and state["growth_interval"] == 5
    other = GradScaler()
    other.load_state_dict(state)
    assert other.get_scale() == 8.0 and other.get_growth_interval() == 5
    assert torch.equal(on.scale(torch.ones(2)), torch.full((2,), 8.0))
    assert [t.tolist() for t in on.scale([torch.ones(1), torch.ones(1)])] == [[8.0], [8.0]]
    with pytest.raises(ValueError):
        GradScaler(growth_factor=0.5)


def test_unscale_then_clip_matches_torch_grad_scaler():
    """SGD (linear in the gradients) with clipping between unscale_ and step,
    against torch.amp.GradScaler on the same model and data. The clip norm
    lies between the true gradient norm and the scaled one: gradients left
    scaled by unscale_ would be clipped and the parameters would differ."""
    torch.manual_seed(5)
    net = classifier()
    ref = copy.deepcopy(net)
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=M))
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    ours, theirs = GradScaler(init_scale=INIT), torch.amp.GradScaler("cpu", init_scale=INIT)
    criterion = torch.nn.CrossEntropyLoss()
    max_norm = 50.0
    norms = []

    def step_fn():
        ours.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.optim_parameters(), max_norm)
        ours.step(opt)
        opt.zero_grad()

    for i in range(4):
        x, y = batch(i)
        model.forward_backward((x,), label=y, loss_fn=lambda out, t: ours.scale(criterion(out, t) / M))
        model.step(step_fn, is_async=False)
        ours.update(is_async=False)
        for part_x, part_y in zip(x.tensor_split(M), y.tensor_split(M)):
            theirs.scale(criterion(ref(part_x), part_y) / M).backward()
        theirs.unscale_(ref_opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)))
        theirs.step(ref_opt)
        theirs.update()
        ref_opt.zero_grad()
    assert max(norms) < max_norm < INIT * min(norms), norms  # the clip tells scaled from unscaled
    assert ours.get_scale() == theirs.get_scale()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), name
