"""pin_model (docs/guide.md, "Where the host parameters live"): "alloc" copies
the parameters into the engine's arenas; "register" and "off" leave them where
they are, so weights memory-mapped from a safetensors file train without a
host copy. All three give the same results, bit for bit."""
import copy

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.safetensors import load_file, save_file
from models import mse_loss_fn, value_model


def data(step):
    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(12, 8, generator=g), torch.randn(12, 3, generator=g)


def train(model, steps=3, num_microbatch=3):
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = data(step)
        loss = model.forward_backward((x,), label=y, loss_fn=mse_loss_fn(num_microbatch))
        losses.append(loss.item())
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    return losses


@pytest.mark.parametrize("mode", ["register", "off"])
def test_parameters_stay_in_place_and_train_like_alloc(mode):
    torch.manual_seed(0)
    net = value_model()
    twin = copy.deepcopy(net)
    before = [p.data_ptr() for p in net.parameters()]
    model = RoundPipe(net, pin_model=mode, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    reference = RoundPipe(twin, pin_model="alloc", model_run_config=RoundPipeRunConfig(num_microbatch=3))
    assert [p.data_ptr() for p in net.parameters()] == before
    assert [p.data_ptr() for p in twin.parameters()] != [p.data_ptr() for p in net.parameters()]
    assert train(model) == train(reference)
    for (name, a), (_, b) in zip(net.state_dict().items(), twin.state_dict().items()):
        assert torch.equal(a, b), name
    # The step wrote the trained weights into the model's own tensors.
    assert [p.data_ptr() for p in net.parameters()] == before


def test_memory_mapped_weights_train_without_a_host_copy(tmp_path):
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    twin = copy.deepcopy(net)
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    path = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, path)
    mapped = load_file(path)  # views of the mapped file
    net.load_state_dict(mapped, assign=True)
    ptrs = {name: p.data_ptr() for name, p in net.named_parameters()}
    assert all(ptrs[name] == mapped[name].data_ptr() for name in ptrs)
    model = RoundPipe(net, pin_model="off", model_run_config=RoundPipeRunConfig(num_microbatch=2))
    reference = RoundPipe(twin, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    assert train(model, num_microbatch=2) == train(reference, num_microbatch=2)
    assert {name: p.data_ptr() for name, p in net.named_parameters()} == ptrs  # still the mapping
    for (name, a), (_, b) in zip(net.state_dict().items(), twin.state_dict().items()):
        assert torch.equal(a, b), name
    assert not torch.equal(net[0].weight, initial["0.weight"])  # it trained
    # The file itself is never written (a private mapping).
    on_disk = load_file(path)
    for name, value in initial.items():
        assert torch.equal(on_disk[name], value), name
