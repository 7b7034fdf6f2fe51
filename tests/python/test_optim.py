"""roundpipe.optim.Adam/AdamW/SGD against torch.optim: same
trajectories over the option grid (relative 1e-6 after 10 steps), state
dicts loadable both ways, clear errors."""
import itertools
import warnings

import pytest
import torch

import roundpipe.optim as rpo

SHAPES = [(0,), (1,), (7,), (16,), (33,), (1024,), (3, 5), (2, 3, 17)]


def run(opt_cls, ref_cls, kwargs, steps=10):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g) for s in SHAPES]
    ours = [p.clone().requires_grad_() for p in params]
    theirs = [p.clone().requires_grad_() for p in params]
    a, b = opt_cls(ours, **kwargs), ref_cls(theirs, **kwargs)
    for _ in range(steps):
        for x, y in zip(ours, theirs):
            grad = torch.randn(x.shape, generator=g)
            x.grad, y.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    for x, y in zip(ours, theirs):
        # Relative to the parameters' scale (~1): elements that pass near zero keep
        # absolute, not relative, agreement.
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-6, atol=1e-6)
    return a, b


ADAM_GRID = list(itertools.product([1e-3, 0.1], [(0.9, 0.999), (0.5, 0.9)], [1e-8, 1e-3], [0.0, 0.1],
                                   [False, True], [False, True]))


@pytest.mark.parametrize("lr,betas,eps,wd,amsgrad,maximize", ADAM_GRID)
def test_adam_matches_torch(lr, betas, eps, wd, amsgrad, maximize):
    kw = dict(lr=lr, betas=betas, eps=eps, weight_decay=wd, amsgrad=amsgrad, maximize=maximize)
    run(rpo.Adam, torch.optim.Adam, kw)
    run(rpo.AdamW, torch.optim.AdamW, kw)


@pytest.mark.parametrize("momentum,dampening,nesterov,wd,maximize",
                         [(0, 0, False, 0, False), (0.9, 0, False, 0.01, False), (0.9, 0.1, False, 0, True),
                          (0.9, 0, True, 0.01, False), (0.5, 0, True, 0, True)])
def test_sgd_matches_torch(momentum, dampening, nesterov, wd, maximize):
    run(rpo.SGD, torch.optim.SGD, dict(lr=0.05, momentum=momentum, dampening=dampening, nesterov=nesterov,
                                       weight_decay=wd, maximize=maximize))


def test_state_dicts_load_both_ways():
    kw = dict(lr=0.01, amsgrad=True)
    ours, theirs = run(rpo.Adam, torch.optim.Adam, kw, steps=3)
    state = ours.state_dict()
    assert set(state["state"][0]) == set(theirs.state_dict()["state"][0])
    fresh = torch.optim.Adam([p for g in ours.param_groups for p in g["params"]], **kw)
    fresh.load_state_dict(state)
    back = rpo.Adam([p for g in theirs.param_groups for p in g["params"]], **kw)
    back.load_state_dict(theirs.state_dict())
    assert back.param_groups[0]["decoupled_weight_decay"] is False
    torch.testing.assert_close(back.state[back.param_groups[0]["params"][0]]["exp_avg"],
                               theirs.state[theirs.param_groups[0]["params"][0]]["exp_avg"])


def test_bad_options_and_params():
    p = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(ValueError, match="learning rate"):
        rpo.Adam(p, lr=-1)
    with pytest.raises(ValueError, match="capturable"):
        rpo.Adam(p, capturable=True)
    with pytest.raises(ValueError, match="Nesterov"):
        rpo.SGD(p, lr=0.1, nesterov=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rpo.Adam(p, foreach=True)
    assert any("ignored" in str(w.message) for w in caught)
    half = [torch.zeros(3, dtype=torch.float16, requires_grad=True)]
    # Refused when given (bfloat16 is accepted, float16 is not), naming the parameter.
    with pytest.raises(TypeError, match=r"parameter 0 \(group 0, position 0\).*float16.*accepted"):
        rpo.Adam(half)
    opt = rpo.SGD(half)
    half[0].grad = torch.ones(3, dtype=torch.float16)
    with pytest.raises(TypeError, match="float"):
        opt.step()
