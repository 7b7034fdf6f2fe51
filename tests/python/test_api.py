"""The Python API around the engine: split/merge specs and functions,
chaining with merge_output=False, pytree values between layers, recompute
hooks, run configs and plans."""
import collections

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe.microbatch import CustomReducer, Replicate, TensorChunkSpec

Pair = collections.namedtuple("Pair", "value note")


class Tagged(nn.Module):
    """Returns a namedtuple holding a tensor and an opaque Python object."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale=1.0, tag=None):
        return Pair(self.lin(x) * scale, {"tag": tag})


class Untag(nn.Module):
    def forward(self, pair):
        assert isinstance(pair, Pair) and isinstance(pair.note, dict)
        return pair.value.sum(1, keepdim=True)


def test_pytree_values_and_kwargs_travel_between_layers():
    net = nn.Sequential(Tagged(), Untag())
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    x = torch.randn(6, 4)
    out = model(x, scale=2.0, tag=object())
    torch.testing.assert_close(out, net[1](net[0](x, scale=2.0)))


def test_specs_and_functions_split_and_merge():
    net = nn.Sequential(nn.Linear(4, 4))
    model = RoundPipe(net)
    x = torch.randn(8, 4)
    calls = []

    def split_input(args, kwargs, n):
        calls.append(n)
        chunks = torch.tensor_split(args[0], n)
        return [(c,) for c in chunks], [{} for _ in chunks]

    cfg = RoundPipeRunConfig(num_microbatch=4, split_input=split_input,
                             merge_output=lambda outs: torch.cat(outs).sum(0))
    torch.testing.assert_close(model(x, roundpipe_run_config=cfg), net(x).sum(0))
    assert calls == [4]
    cfg = RoundPipeRunConfig(num_microbatch=2, split_input=((TensorChunkSpec(0),), None),
                             merge_output=CustomReducer(torch.zeros(4), lambda a, b: a + b.sum(0)))
    torch.testing.assert_close(model(x, roundpipe_run_config=cfg), net(x).sum(0))
    with pytest.raises(ValueError, match="bad_split"):
        def bad_split(args, kwargs, n):
            return [args], [kwargs]
        model(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=2, split_input=bad_split))
    with pytest.raises(TypeError, match="spec leaf"):
        model(x, roundpipe_run_config=RoundPipeRunConfig(split_input=((3,), None)))


def test_chaining_two_models_without_merging():
    first, second = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 2))
    a, b = RoundPipe(first), RoundPipe(second)
    x = torch.randn(6, 4)
    mid = a(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=3, merge_output=False))
    assert isinstance(mid, roundpipe._C.MicrobatchValues) and len(mid) == 3
    out = b(mid, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=3))
    torch.testing.assert_close(out, second(first(x)))


class Remembering(nn.Module):
    seen = []  # on the class: each device runs a deep copy of the layer

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if roundpipe.doing_recompute():
            (saved,) = roundpipe.get_recompute_data()
            self.seen.append(saved)
        else:
            roundpipe.save_for_recompute(x.detach().sum())
        return self.lin(x)


def test_recompute_hooks():
    layer = Remembering()
    net = nn.Sequential(layer, nn.Linear(4, 1))
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=1))
    x = torch.randn(3, 4)
    plan = ModelExecutePlan([range(0, 1)], [range(1, 2), range(0, 1)])  # layer 0 is recomputed
    model.forward_backward((x,), loss_fn=lambda out, _: out.sum(), run_config=RoundPipeRunConfig(execute_plan=plan))
    model.synchronize()  # the backward stages (and their recomputation) may still run until then
    assert len(layer.seen) == 1 and torch.equal(layer.seen[0], x.sum())
    with pytest.raises(AssertionError):
        roundpipe.get_recompute_data()
    assert not roundpipe.doing_recompute()
    assert layer.lin.weight.grad is not None


def test_plans_and_devices():
    model = RoundPipe(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)))
    plan = model.default_execute_plan("fused")
    assert isinstance(plan, ModelExecutePlan) and plan.bwd_plan[0].stop == 3
    assert model.num_devices() == roundpipe.get_num_devices() >= 1
    bad = ModelExecutePlan([range(0, 2)], [range(2, 3), range(0, 2)])
    with pytest.raises(ValueError, match="forward"):
        model(torch.randn(2, 4), roundpipe_run_config=RoundPipeRunConfig(execute_plan=bad))
    with pytest.raises(TypeError, match="range"):
        ModelExecutePlan([(0, 2)])


def test_to_dtype_rebuilds_and_frozen_parameters_get_no_copies():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    net[0].weight.requires_grad_(False)
    model = RoundPipe(net)
    assert len(list(model.optim_parameters())) == 3
    model.to(torch.float64)
    assert net[1].weight.dtype == torch.float64
    out = model.forward_backward((torch.randn(4, 4, dtype=torch.float64),), loss_fn=lambda o, _: o.sum())
    assert out.dtype == torch.float64


def test_auto_plans_validate_and_balance():
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    model = RoundPipe(net)
    plan = ModelExecutePlan.auto("fused", model, min_stages=3)
    assert isinstance(plan, ModelExecutePlan) and plan.bwd_plan[0].stop == 6
    assert len(plan.fwd_plan) + 1 >= 3
    x = torch.randn(4, 8)
    model.forward_backward((x,), loss_fn=lambda o, _: o.sum(), run_config=RoundPipeRunConfig(execute_plan=plan))
    plans = ModelExecutePlan.auto("infer", model, RoundPipe(nn.Sequential(nn.Linear(8, 8))))
    assert len(plans) == 2 and plans[1].fwd_plan == [range(0, 1)]
    with pytest.raises(ValueError, match="run_type"):
        ModelExecutePlan.auto("both", model)


def test_step_forwards_its_extra_arguments_to_step_fn():
    model = RoundPipe(torch.nn.Linear(3, 2))
    seen = []
    model.forward_backward((torch.randn(4, 3),), loss_fn=lambda out, _: out.sum())
    model.step(lambda *args, **kwargs: seen.append((args, kwargs)), False, 1, "two", three=3)
    model.step(lambda *args, **kwargs: seen.append((args, kwargs)), True, 4)
    model.step(lambda: seen.append("none"))
    model.synchronize()
    assert seen == [((1, "two"), {"three": 3}), ((4,), {}), "none"]
