"""Test models of user-defined Python layers, and the plain PyTorch loop that
defines what RoundPipe must compute (the loop of RoundPipe.forward_backward)."""
import torch
from torch import nn


class Encode(nn.Module):
    """x -> (h, x); counts its calls in a buffer replaced by assignment."""

    def __init__(self, shared):
        super().__init__()
        self.shared = shared
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls = self.calls + 1
        return (torch.tanh(self.shared(x)), x)


class Counter(nn.Module):
    """Counts its calls in a buffer updated in place and scales by the count:
    a written buffer whose value reaches the output."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return x * (1 + 0.01 * self.calls)


class Mix(nn.Module):
    """(h, x) -> {"h", "skip"}; keeps a running mean updated in place."""

    def __init__(self, width, dropout=0.0):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("running", torch.zeros(width))

    def forward(self, inputs):
        h, x = inputs
        self.running.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return {"h": self.drop(torch.tanh(self.lin(h))), "skip": x}


class DictBlock(nn.Module):
    """{"h", "skip"} -> {"h", "skip"}."""

    def __init__(self, width, dropout=0.0):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, d):
        return {"h": self.drop(torch.tanh(self.lin(d["h"]))) + d["h"], "skip": d["skip"]}


class Head(nn.Module):
    """{"h", "skip"} -> logits; reuses the shared layer (a tied parameter)."""

    def __init__(self, shared, width, n_out):
        super().__init__()
        self.shared = shared
        self.out = nn.Linear(width, n_out)

    def forward(self, d):
        return self.out(self.shared(d["h"]) + d["skip"])


def value_model(width=8, n_out=3, dropout=0.0):
    shared = nn.Linear(width, width)
    return nn.Sequential(Encode(shared), Mix(width, dropout), DictBlock(width, dropout), DictBlock(width, dropout),
                         Head(shared, width, n_out))


def mse_loss_fn(num_microbatch):
    return lambda outputs, labels: nn.functional.mse_loss(outputs, labels) / num_microbatch


def reference_forward_backward(model, args, label, loss_fn, num_microbatch):
    """RoundPipe.forward_backward's loop in plain PyTorch: returns (summed
    loss, merged outputs)."""
    xs = torch.tensor_split(args[0], num_microbatch)
    ys = torch.tensor_split(label, num_microbatch)
    total, outs = 0.0, []
    for x, y in zip(xs, ys):
        out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        total = total + loss.detach()
        outs.append(out.detach())
    return total, torch.cat(outs)


def assert_close(actual, expected, rtol=1e-5, atol=1e-7, what=""):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
