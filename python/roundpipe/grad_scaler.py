"""GradScaler (docs/python.md, "GradScaler"): dynamic loss scaling that is
safe across RoundPipe's threads. Interface-compatible with
``torch.amp.GradScaler``.

- ``scale(outputs)`` runs inside ``loss_fn`` on the device workers;
- ``unscale_(optimizer)`` and ``step(optimizer)`` run inside ``step_fn`` on the
  optimizer thread (called elsewhere, they are run there and waited for);
- ``update()`` runs on the main thread (the one that created the scaler).

Each step's gradients are unscaled by the scale that produced them, even
though the optimizer thread runs one iteration behind. With
``update(is_async=True)`` (default) a new scale takes effect one update later,
like the parameters' one-step delay; ``is_async=False`` waits for the step and
applies it at once (exactly torch's rule). The exact semantics are documented
in include/roundpipe/grad_scaler.h.

``torch.amp.GradScaler`` / ``torch.cuda.amp.GradScaler`` are not thread-safe
and do not know which scale produced which gradients: do not use them with
asynchronous steps.
"""
import functools
import inspect
import threading
from typing import Any, Dict, Optional, Union

import torch

from . import _C


def _referenced(fn):
    """The objects a step function reaches by name: a partial's arguments, a
    bound method's object, the function's closure, defaults and the globals
    it names, and their attributes named in its code (``self.scaler``)."""
    found = []
    while True:
        if isinstance(fn, functools.partial):
            found += [*fn.args, *fn.keywords.values()]
            fn = fn.func
        elif inspect.ismethod(fn):
            found.append(fn.__self__)
            fn = fn.__func__
        else:
            break
    code = getattr(fn, "__code__", None)
    if code is None:
        return found
    for cell in fn.__closure__ or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:  # a variable not yet assigned
            pass
    found += list(fn.__defaults__ or ())
    scope = getattr(fn, "__globals__", {})
    names = set(code.co_names)
    for const in code.co_consts:  # the names of nested functions and comprehensions too
        if inspect.iscode(const):
            names.update(const.co_names)
    found += [scope[name] for name in names if name in scope]
    found += [getattr(obj, name) for obj in list(found) if hasattr(obj, "__dict__") and not inspect.ismodule(obj)
              for name in names if name in vars(obj)]
    return found


def _check_no_torch_scaler(step_fn):
    """torch.amp.GradScaler in an asynchronous step fails at its update()
    with "No inf checks were recorded prior to update": its step has not run
    yet. Detected up front where the step function names it."""
    try:
        objects = _referenced(step_fn)
    except Exception:  # an exotic callable: nothing to detect
        return
    for obj in objects:
        if isinstance(obj, torch.amp.GradScaler) and obj.is_enabled():
            raise TypeError(
                f"step: step_fn uses a {type(obj).__module__}.{type(obj).__qualname__}, which cannot follow "
                "asynchronous steps (its update() would find no inf checks, the step not having run yet, and "
                "it does not know which scale produced which gradients): use roundpipe.GradScaler, a drop-in "
                "replacement (docs/python.md, \"GradScaler\"), or step(..., is_async=False)")


def _grads(optimizer):
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


class GradScaler:
    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        self._enabled = bool(enabled)
        self._main_thread = threading.get_ident()
        self._last_used = None  # the scale the latest scale() call used
        self._core = _C.GradScalerCore(float(init_scale), float(growth_factor), float(backoff_factor),
                                       int(growth_interval), self._enabled)

    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a tensor or an iterable of tensors) times the scale."""
        if not self._enabled:
            return outputs
        s = self._core.get_scale()
        self._last_used = s

        def apply(value):
            if isinstance(value, torch.Tensor):
                return value * s
            if isinstance(value, (list, tuple)):
                return type(value)(apply(v) for v in value)
            if hasattr(value, "__iter__"):
                return map(apply, value)
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the optimizer's gradients by the scale that produced them
        and records whether one is inf/NaN."""
        if not self._enabled:
            return
        if not _C.on_optimizer_thread():
            _C.run_on_optimizer_thread(lambda: self.unscale_(optimizer))
            return
        self._core.unscale_grads(id(optimizer), _grads(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscales if needed; ``optimizer.step(*args, **kwargs)`` unless a
        gradient was inf/NaN. Returns what optimizer.step returned (None when
        skipped, or when called off the optimizer thread)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        if not _C.on_optimizer_thread():
            _C.run_on_optimizer_thread(lambda: self.step(optimizer, *args, **kwargs))
            return None
        if self._core.prepare_step(id(optimizer), _grads(optimizer)):
            return optimizer.step(*args, **kwargs)
        return None

    def update(self, new_scale: Union[float, torch.Tensor, None] = None, is_async: bool = True) -> None:
        """Backoff after a skipped step, growth after growth_interval clean
        steps. Main thread only (RuntimeError elsewhere)."""
        if not self._enabled:
            return
        if isinstance(new_scale, torch.Tensor):
            new_scale = float(new_scale.item())
        self._core.update(None if new_scale is None else float(new_scale), bool(is_async))
        if not is_async:
            self._last_used = None  # the new scale is in effect at once, as torch's

    def get_scale(self) -> float:
        """The calling thread's scale (1.0 when disabled). On the main thread:
        the scale the latest forward_backward's losses were scaled with (until
        the next one scales), so ``loss.item() / scaler.get_scale()`` after
        ``update()`` is the real loss; elsewhere: the scale in effect there."""
        if not self._enabled:
            return 1.0
        if threading.get_ident() == self._main_thread and self._last_used is not None:
            return self._last_used
        return self._core.get_scale()

    def get_growth_factor(self, up_to_date: bool = False) -> float:
        return self._core.get_growth_factor(up_to_date)

    def set_growth_factor(self, new_factor: float) -> None:
        self._core.set_growth_factor(float(new_factor))

    def get_backoff_factor(self, up_to_date: bool = False) -> float:
        return self._core.get_backoff_factor()

    def set_backoff_factor(self, new_factor: float) -> None:
        self._core.set_backoff_factor(float(new_factor))

    def get_growth_interval(self, up_to_date: bool = False) -> int:
        return self._core.get_growth_interval()

    def set_growth_interval(self, new_interval: int) -> None:
        self._core.set_growth_interval(int(new_interval))

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> Dict[str, Any]:
        return self._core.state_dict() if self._enabled else {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not self._enabled:
            return
        self._core.load_state_dict(dict(state_dict))
        self._last_used = None
