"""Shared set-up of the Python tests: CPU virtual devices (cpu:2 unless the
environment says otherwise), deterministic threads, small models."""
import os

os.environ.setdefault("ROUNDPIPE_DEVICES", "cpu:2")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


class HalfLinear(torch.nn.Module):
    """A linear layer built from ops that also have fp16 CPU kernels."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_in, n_out) / n_in ** 0.5)
        self.bias = torch.nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return (x.unsqueeze(-1) * self.weight).sum(-2) + self.bias


class LeakyAct(torch.nn.Module):
    def forward(self, x):
        return torch.where(x > 0, x, x * 0.1)


class Gain(torch.nn.Module):
    """Scales the logits, so that small steps (Adam at lr 1e-3) train fast."""

    def __init__(self, gain):
        super().__init__()
        self.gain = gain

    def forward(self, x):
        return x * self.gain


def classifier(n_in=8, hidden=16, n_classes=4, gain=8.0):
    """A small classifier whose layers run in fp32 and fp16 on the CPU."""
    return torch.nn.Sequential(HalfLinear(n_in, hidden), LeakyAct(), HalfLinear(hidden, hidden), LeakyAct(),
                               HalfLinear(hidden, n_classes), Gain(gain))


def classification_data(n=64, n_in=8, n_classes=4, seed=0):
    """Inputs drawn with `seed`, labelled by one fixed linear teacher."""
    teacher = torch.randn(n_in, n_classes, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, n_in, generator=torch.Generator().manual_seed(seed))
    return x, (x @ teacher).argmax(1)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield
