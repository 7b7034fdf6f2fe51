"""Vectorized CPU optimizers (docs/python.md, "API summary"): drop-ins for
torch.optim.Adam, AdamW and SGD over fp32 or complex64, contiguous, dense
CPU tensors (the optimizer copies; complex tensors are updated as pairs of
reals, as torch.optim does).

Same update math as torch.optim's single-tensor implementations (results
within 1e-6 relative), same state dict layout; the update of each parameter
is one SIMD pass over memory (AVX-512, AVX2 or portable, chosen at run time;
ROUNDPIPE_SIMD=scalar|avx2|avx512 forces one), multithreaded, with the GIL
released.
"""
import warnings

import torch

from . import _C


def _check_unsupported(name, capturable, differentiable, foreach, fused):
    if capturable:
        raise ValueError(f"roundpipe.optim.{name}: capturable=True is not supported "
                         "(these optimizers run on the CPU optimizer copies)")
    if differentiable:
        raise ValueError(f"roundpipe.optim.{name}: differentiable=True is not supported")
    if foreach is not None or fused is not None:
        warnings.warn(f"roundpipe.optim.{name}: foreach/fused are ignored (the update is always one fused "
                      "vectorized pass)", stacklevel=3)


def _real(tensors):
    """Complex tensors as views of their real pairs (torch.optim's rule)."""
    return [torch.view_as_real(t) if t.is_complex() else t for t in tensors]


def _closure_loss(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Adam(torch.optim.Optimizer):
    """torch.optim.Adam's interface; ``decoupled_weight_decay=True`` is AdamW."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False):
        if isinstance(lr, torch.Tensor):
            lr = float(lr)
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        _check_unsupported(type(self).__name__, capturable, differentiable, foreach, fused)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=False, differentiable=False,
                        fused=fused, decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("decoupled_weight_decay", self._decoupled_default())
        for s in self.state.values():
            if "step" in s and not torch.is_tensor(s["step"]):
                s["step"] = torch.tensor(float(s["step"]))

    def _decoupled_default(self):
        return False

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], [], [], []
            amsgrad = group["amsgrad"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Adam does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if amsgrad:
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if amsgrad and "max_exp_avg_sq" not in state:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                if amsgrad:
                    max_sqs.append(state["max_exp_avg_sq"])
                steps.append(state["step"])
            if not params:
                continue
            beta1, beta2 = group["betas"]
            counts = [int(s.item()) + 1 for s in steps]
            _C.adam_step(_real(params), _real(grads), _real(exp_avgs), _real(exp_avg_sqs), _real(max_sqs), counts,
                         float(group["lr"]),
                         float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                         bool(amsgrad), bool(group["maximize"]), bool(group["decoupled_weight_decay"]))
            for s in steps:
                s += 1
        return loss


class AdamW(Adam):
    """torch.optim.AdamW's interface (Adam with decoupled weight decay)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         foreach=foreach, maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused, decoupled_weight_decay=True)

    def _decoupled_default(self):
        return True


class SGD(torch.optim.Optimizer):
    """torch.optim.SGD's interface (momentum, dampening, nesterov,
    weight_decay, maximize)."""

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None):
        if isinstance(lr, torch.Tensor):
            lr = float(lr)
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        _check_unsupported("SGD", False, differentiable, foreach, fused)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=False,
                        fused=fused)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)
            group.setdefault("maximize", False)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            params, grads, buffers, first = [], [], [], []
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("SGD does not support sparse gradients")
                state = self.state[p]
                params.append(p)
                grads.append(p.grad)
                if momentum != 0:
                    buf = state.get("momentum_buffer")
                    first.append(buf is None)
                    if buf is None:
                        buf = torch.empty_like(p, memory_format=torch.contiguous_format)
                        state["momentum_buffer"] = buf
                    buffers.append(buf)
                else:
                    state["momentum_buffer"] = None
            if not params:
                continue
            _C.sgd_step(_real(params), _real(grads), _real(buffers), first, float(group["lr"]), float(momentum),
                        float(group["dampening"]), float(group["weight_decay"]), bool(group["nesterov"]),
                        bool(group["maximize"]))
        return loss


# The other optimizers users port from the reference: torch.optim's own
# implementations (foreach over the CPU optimizer copies), under the same names.
Adadelta = torch.optim.Adadelta
Adafactor = torch.optim.Adafactor
Adagrad = torch.optim.Adagrad
Adamax = torch.optim.Adamax
ASGD = torch.optim.ASGD
NAdam = torch.optim.NAdam
RAdam = torch.optim.RAdam
RMSprop = torch.optim.RMSprop
Rprop = torch.optim.Rprop

__all__ = ["Adam", "AdamW", "SGD", "Adadelta", "Adafactor", "Adagrad", "Adamax", "ASGD", "NAdam", "RAdam",
           "RMSprop", "Rprop"]
