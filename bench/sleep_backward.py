"""What B9's and B11's layers do instead of a GPU kernel's work: the
identity, whose backward sleeps (a device busy without a host core)."""
import time

import torch


def sleep_backward(seconds):
    """An autograd function: forward returns a copy of its input, backward
    sleeps ``seconds`` and passes the gradient on."""

    class SleepBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            time.sleep(seconds)
            return g

    return SleepBackward
