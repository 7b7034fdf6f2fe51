"""Vectorized CPU optimizers (docs/python.md, "API summary"): drop-ins for
torch.optim.Adam, AdamW and SGD over fp32 or complex64, contiguous, dense
CPU tensors (the optimizer copies; complex tensors are updated as pairs of
reals, as torch.optim does). Adam and AdamW also update bfloat16 parameters,
in fp32 and stored with stochastic rounding (see Adam).

Same update math as torch.optim's single-tensor implementations (results
within 1e-6 relative), same state dict layout; the update of each parameter
is one SIMD pass over memory (AVX-512, AVX2 or portable, chosen at run time;
ROUNDPIPE_SIMD=scalar|avx2|avx512 forces one), multithreaded, with the GIL
released.
"""
import warnings
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

import torch

from . import _C

# What torch.optim's constructors take: tensors, or parameter groups.
Params = Union[Iterable[torch.Tensor], Iterable[Dict[str, Any]]]
StateDtype = Union[torch.dtype, str, None]


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


# state_dtype: the accepted values, and the canonical name kept in each group.
_STATE_DTYPES = {None: "float32", torch.float32: "float32", "float32": "float32",
                 torch.bfloat16: "bfloat16", "bfloat16": "bfloat16",
                 "int8": "int8", "blockwise8": "int8"}
# The kernels' name of each format.
_KERNEL_FORMAT = {"float32": "float32", "bfloat16": "bfloat16", "int8": "blockwise8"}
# The format of a stored state, by exp_avg's dtype (complex64: fp32 pairs).
_STORED_FORMAT = {torch.float32: "float32", torch.complex64: "float32", torch.bfloat16: "bfloat16",
                  torch.uint8: "int8"}
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")


def _state_dtype_name(name, value):
    try:
        return _STATE_DTYPES[value]
    except (KeyError, TypeError):
        raise ValueError(f"roundpipe.optim.{name}: invalid state_dtype {value!r}; accepted: torch.float32 or None "
                         "(the default), torch.bfloat16 (or 'bfloat16'), 'int8' (8-bit blockwise, or "
                         "'blockwise8')") from None


def _state_format(state_dtype, param):
    """The format a parameter's states are kept in under a group's state_dtype."""
    if state_dtype == "int8" and param.numel() < _C.adam_min_blockwise8_numel:
        return "float32"
    return state_dtype


# The parameter dtypes each optimizer updates, for the message that refuses others.
_ADAM_DTYPES = (torch.float32, torch.bfloat16, torch.complex64)
_SGD_DTYPES = (torch.float32, torch.complex64)


def _check_param_dtypes(name, param_groups, accepted, what):
    """TypeError naming the first parameter whose dtype is not `accepted`."""
    index = 0
    for g, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            if p.dtype not in accepted:
                raise TypeError(f"roundpipe.optim.{name}: parameter {index} (group {g}, position {i}) "
                                f"{tuple(p.shape)} is {p.dtype}; accepted: {what}")
            index += 1


def _places(param_groups):
    """{id(param): (index over all groups, group, position)}: what names a
    parameter in messages and seeds the stochastic rounding of a bf16 one."""
    places = {}
    index = 0
    for g, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            places[id(p)] = (index, g, i)
            index += 1
    return places


def _closure_loss(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Adam(torch.optim.Optimizer):
    """torch.optim.Adam's interface; ``decoupled_weight_decay=True`` is AdamW.

    ``state_dtype`` (per group) chooses how exp_avg/exp_avg_sq (and
    max_exp_avg_sq) are kept: ``torch.float32`` or None (default, 8 bytes per
    element), ``torch.bfloat16`` (4 bytes, rounded to nearest even after each
    step) or ``"int8"`` (8-bit blockwise as bitsandbytes' Adam8bit, about 2
    bytes: uint8 codes in ``exp_avg``/``exp_avg_sq`` and one float32 scale per
    256 elements in ``exp_avg_absmax``/``exp_avg_sq_absmax``; tensors under 4096
    elements keep fp32 states; no amsgrad). load_state_dict() converts the
    loaded states to each group's state_dtype (which it keeps: it is not taken
    from the loaded dict).

    Parameters: float32, complex64 (fp32 states only) or bfloat16. A bfloat16
    parameter (with a bf16 or fp32 gradient) is its own optimizer copy, 2 bytes
    per element instead of 4 and no compensation term: each step widens it to
    fp32, runs the fp32 update with the group's states (any state_dtype,
    amsgrad too) and stores it with stochastic rounding, so updates far below
    half a bf16 ulp still move it on average. The rounding draws from a hash
    seeded by the parameter's index over all groups and the state's step (the
    exact rule: roundpipe/optim/adam.h), so runs, and runs resumed from a
    state dict, repeat bitwise on any SIMD path and thread count. Other dtypes
    (float16, float64, complex128) are a TypeError naming the parameter.
    """

    def __init__(self, params: Params, lr: Union[float, torch.Tensor] = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, amsgrad: bool = False, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None, decoupled_weight_decay: bool = False,
                 state_dtype: StateDtype = None) -> None:
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
                        fused=fused, decoupled_weight_decay=decoupled_weight_decay,
                        state_dtype=_state_dtype_name(type(self).__name__, state_dtype))
        super().__init__(params, defaults)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        name = type(self).__name__
        if "state_dtype" in param_group:
            param_group = dict(param_group)
            param_group["state_dtype"] = _state_dtype_name(name, param_group["state_dtype"])
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._check_group(len(self.param_groups) - 1, group)

    def _check_group(self, g, group):
        name = type(self).__name__
        if group["state_dtype"] == "int8" and group["amsgrad"]:
            raise ValueError(f"roundpipe.optim.{name}: amsgrad is not supported with state_dtype='int8' "
                             f"(parameter group {g}); use state_dtype=torch.bfloat16 or torch.float32")
        _check_param_dtypes(name, self.param_groups[:g] + [group], _ADAM_DTYPES,
                            "torch.float32, torch.bfloat16 (stored with stochastic rounding) or "
                            "torch.complex64")
        if group["state_dtype"] != "float32":
            index = sum(len(other["params"]) for other in self.param_groups[:g])
            for i, p in enumerate(group["params"]):
                if p.dtype == torch.complex64:
                    raise ValueError(
                        f"roundpipe.optim.{name}: parameter {index + i} (group {g}, position {i}) "
                        f"{tuple(p.shape)} is {p.dtype}; state_dtype={group['state_dtype']!r} supports "
                        "float32 and bfloat16 parameters only (use state_dtype=torch.float32 for this "
                        "parameter's group)")

    def _param_index(self, param):
        index = 0
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p is param:
                    return index, g, i
                index += 1
        raise KeyError("parameter not in this optimizer")

    def _conform_state(self, p, state, want):
        """Converts a parameter's state to the format `want` (checking it)."""
        current = (state["exp_avg"], state["exp_avg_sq"]) + tuple(state.get(k) for k in _STATE_KEYS[2:])
        index, g, i = self._param_index(p)
        out = _C.adam_convert_state(type(self).__name__, index, g, i, p.numel(), *current, _KERNEL_FORMAT[want])
        for key, value in zip(_STATE_KEYS, out):
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        # torch.optim casts floating-point states to the parameter's dtype
        # (which would turn bf16 states and 8-bit codes into float32); keep the
        # loaded tensors as they are, then convert them to this optimizer's
        # state_dtype.
        dtypes = [group["state_dtype"] for group in self.param_groups]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        saved = {k: dict(v) for k, v in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for pid, p in zip(saved_ids, params):
            if pid not in saved or p not in self.state:
                continue
            for key in _STATE_KEYS:
                value = saved[pid].get(key)
                if torch.is_tensor(value):
                    self.state[p][key] = value.to(device=p.device)
        for group, dtype in zip(self.param_groups, dtypes):
            group["state_dtype"] = dtype
            for p in group["params"]:
                state = self.state.get(p)
                if state and "exp_avg" in state:
                    self._conform_state(p, state, _state_format(dtype, p))

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("decoupled_weight_decay", self._decoupled_default())
            group.setdefault("state_dtype", self.defaults.get("state_dtype", "float32"))
        for s in self.state.values():
            if "step" in s and not torch.is_tensor(s["step"]):
                s["step"] = torch.tensor(float(s["step"]))

    def _decoupled_default(self):
        return False

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Optional[Any]:  # type: ignore[override]
        loss = _closure_loss(closure)
        places = _places(self.param_groups)
        for g, group in enumerate(self.param_groups):
            self._check_group(g, group)
            params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], [], [], []
            # Parameters with compact states or bf16 parameters: one kernel
            # widens and narrows what is stored in fewer bytes.
            compact = {k: [] for k in ("places", "params", "grads", "steps") + _STATE_KEYS}
            amsgrad = group["amsgrad"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Adam does not support sparse gradients")
                state = self.state[p]
                want = _state_format(group["state_dtype"], p)
                # fp32 states of a bf16 parameter are float32, not its dtype.
                fp32_states = torch.float32 if p.dtype == torch.bfloat16 else p.dtype
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format, dtype=fp32_states)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format, dtype=fp32_states)
                    if amsgrad:
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format,
                                                                   dtype=fp32_states)
                    if want != "float32":
                        self._conform_state(p, state, want)
                elif _STORED_FORMAT.get(state["exp_avg"].dtype, want) != want:
                    # A state in another format (state_dtype changed, or set by hand).
                    self._conform_state(p, state, want)
                if amsgrad and "max_exp_avg_sq" not in state:
                    state["max_exp_avg_sq"] = (torch.zeros_like(p, memory_format=torch.preserve_format,
                                                                dtype=fp32_states)
                                               if want == "float32" else torch.zeros_like(state["exp_avg_sq"]))
                if want != "float32" or p.dtype == torch.bfloat16:
                    compact["places"].append(places[id(p)])
                    compact["params"].append(p)
                    compact["grads"].append(p.grad)
                    compact["steps"].append(state["step"])
                    for key in _STATE_KEYS:
                        compact[key].append(state.get(key) if key != "max_exp_avg_sq" or amsgrad else None)
                    continue
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                if amsgrad:
                    max_sqs.append(state["max_exp_avg_sq"])
                steps.append(state["step"])
            beta1, beta2 = group["betas"]
            hyper = (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                     bool(amsgrad), bool(group["maximize"]), bool(group["decoupled_weight_decay"]))
            if params:
                counts = [int(s.item()) + 1 for s in steps]
                _C.adam_step(_real(params), _real(grads), _real(exp_avgs), _real(exp_avg_sqs), _real(max_sqs), counts,
                             *hyper)
                for s in steps:
                    s += 1
            if compact["params"]:
                counts = [int(s.item()) + 1 for s in compact["steps"]]
                _C.adam_step_compact(compact["places"], compact["params"], compact["grads"],
                                     *(compact[k] for k in _STATE_KEYS), counts, *hyper)
                for s in compact["steps"]:
                    s += 1
        return loss


class AdamW(Adam):
    """torch.optim.AdamW's interface (Adam with decoupled weight decay); see
    Adam for ``state_dtype``."""

    def __init__(self, params: Params, lr: Union[float, torch.Tensor] = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, state_dtype: StateDtype = None) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         foreach=foreach, maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused, decoupled_weight_decay=True,
                         state_dtype=state_dtype)

    def _decoupled_default(self):
        return True


class Adam8bit(Adam):
    """Adam with 8-bit blockwise states (``state_dtype="int8"``)."""

    def __init__(self, params: Params, lr: Union[float, torch.Tensor] = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, *, maximize: bool = False,
                 foreach: Optional[bool] = None, fused: Optional[bool] = None) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach,
                         maximize=maximize, fused=fused, state_dtype="int8")


class AdamW8bit(AdamW):
    """AdamW with 8-bit blockwise states (``state_dtype="int8"``)."""

    def __init__(self, params: Params, lr: Union[float, torch.Tensor] = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, maximize: bool = False,
                 foreach: Optional[bool] = None, fused: Optional[bool] = None) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize,
                         foreach=foreach, fused=fused, state_dtype="int8")


class SGD(torch.optim.Optimizer):
    """torch.optim.SGD's interface (momentum, dampening, nesterov,
    weight_decay, maximize). float32 and complex64 parameters; others
    (bfloat16 included) are a TypeError naming the parameter at step()."""

    _ACCEPTED = "torch.float32 or torch.complex64 (bfloat16 parameters: use Adam/AdamW)"

    def __init__(self, params: Params, lr: Union[float, torch.Tensor] = 1e-3, momentum: float = 0,
                 dampening: float = 0, weight_decay: float = 0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, differentiable: bool = False,
                 fused: Optional[bool] = None) -> None:
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
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Optional[Any]:  # type: ignore[override]
        loss = _closure_loss(closure)
        _check_param_dtypes("SGD", self.param_groups, _SGD_DTYPES, self._ACCEPTED)
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

__all__ = ["Adam", "AdamW", "Adam8bit", "AdamW8bit", "SGD", "Adadelta", "Adafactor", "Adagrad", "Adamax", "ASGD", "NAdam", "RAdam",
           "RMSprop", "Rprop"]
