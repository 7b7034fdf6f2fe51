"""RoundPipe: a host-resident model run as a pipeline over the devices (docs/python.md)."""
import atexit
import functools
import os
import sys
import warnings
import weakref

from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from . import _C, _optimizer_guard
from .grad_scaler import _check_no_torch_scaler
from .microbatch import _batch_size, _with_packed_split
from .run_config import _FIELDS as _RUN_CONFIG_FIELDS, RoundPipeRunConfig
from .tiling import SequenceTileSetting

if TYPE_CHECKING:
    from .timer import ModelTimer

_PIN_MODES = ("alloc", "register", "off")


# Models still alive when the interpreter exits are closed first: their
# engine threads may need the interpreter to release Python objects.
_live_engines = weakref.WeakSet()


@atexit.register
def _close_live_engines():
    for engine in list(_live_engines):
        engine.close()
    # Models released where they could not be destroyed (on an engine thread,
    # or under the GIL) are destroyed on another thread, and an engine thread
    # may still run Python (a step_fn collecting garbage): let both finish
    # while the interpreter still runs, then keep engine threads out of it.
    _C.close_engine_threads_gate()


def load_into_matching(wrapper: nn.Module, others: List[nn.Module], state_dict: Mapping[str, Any],
                       strict: bool) -> Any:
    """Loads ``state_dict`` into the module whose keys it uses: ``wrapper``
    (its own keys, ``model.``-prefixed) or one of ``others`` (the wrapped
    model's keys); the most matching keys win, ``wrapper`` on a tie."""
    candidates = [wrapper, *others]
    keys = set(state_dict.keys()) if hasattr(state_dict, "keys") else set()
    scores = [len(keys & set(nn.Module.state_dict(m) if m is wrapper else m.state_dict())) for m in candidates]
    owner = candidates[scores.index(max(scores))]
    if owner is wrapper:
        return nn.Module.load_state_dict(wrapper, state_dict, strict=strict)
    return owner.load_state_dict(state_dict, strict=strict)


def _default_loss_fn(outputs, labels):
    return outputs


class _Loss(torch.Tensor):
    """The loss ``forward_backward`` returns: a plain detached CPU tensor
    (operations on it give plain tensors) whose ``backward()`` says why there
    is nothing left to do, instead of torch's "does not require grad"."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def backward(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "forward_backward has already run the backward pass and accumulated the gradients; the loss "
            "it returns is detached, for logging. Apply the gradients with model.step(...); for a "
            "backward pass of your own, call model(...) and then loss.backward()")

    def __repr__(self, **kwargs):
        return repr(self.as_subclass(torch.Tensor))

    def __deepcopy__(self, memo):
        return self.as_subclass(torch.Tensor).clone()

    def __reduce_ex__(self, protocol):
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


def _as_loss(value):
    """``forward_backward``'s result (a tensor or a list of them) as _Loss."""
    if isinstance(value, torch.Tensor) and not value.requires_grad:
        return torch.Tensor._make_subclass(_Loss, value)
    if isinstance(value, list):
        return [_as_loss(v) for v in value]
    return value


def check_grad_mode(who):
    if not torch.is_grad_enabled():
        raise RuntimeError(f"{who}.forward_backward computes gradients, but grad mode is off (torch.no_grad() or "
                           "torch.inference_mode()); call it with grad mode on, or call the model itself "
                           "for a forward pass without gradients")


def check_is_async(is_async):
    if not isinstance(is_async, bool):
        raise TypeError(f"step: is_async must be a bool, got {is_async!r}; step_fn's own arguments follow it "
                        "(step(step_fn, True, *args)), or bind them: step(functools.partial(step_fn, ...))")


def warn_small_batch(model, n, batch, stacklevel=4):
    """The batch-smaller-than-num_microbatch warning, once per model."""
    if not model.__dict__.get("_warned_small_batch"):
        model.__dict__["_warned_small_batch"] = True
        warnings.warn(f"{type(model).__name__} '{model.name}': num_microbatch {n} is larger than the batch size "
                      f"{batch}; using {batch} (said once per model)", UserWarning, stacklevel=stacklevel)


def _caller_name(depth=2):
    frame = sys._getframe(depth)
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


class RoundPipe(nn.Module):
    """A ``torch.nn.Module`` that wraps ``model`` (an ``nn.Sequential``: each child is a layer; any other
    ``nn.Module``: one layer). Parameters and buffers must be on the CPU: they
    stay the master copy, moved into one contiguous host arena per layer (the
    module's tensors keep their identity).

    - ``optim_dtype``: dtype of the optimizer copies (default: the parameters'
      dtype), e.g. fp16/bf16 model with fp32 optimizer copies. With
      ``torch.bfloat16`` copies (the compact configuration, with
      ``roundpipe.optim.AdamW8bit``, which rounds their updates
      stochastically) the gradients are kept in bf16 as well: one gradient
      per parameter, summed over calls with stochastic rounding.
    - ``name``: shown in errors, logs and traces (default ``"<file>:<line>"``).
    - ``model_run_config``: defaults for every call (RoundPipeRunConfig).
    - ``pin_model``: ``"alloc"`` (default: the parameters are copied into one
      exact-size arena per layer, page-locked with GPU devices),
      ``"register"`` (left in place, page-locked in place with GPU devices)
      or ``"off"`` (left in place, never page-locked: memory-mapped weights
      stay mapped, no host copy is made).
    - ``process_group``: data parallelism with the other processes of this
      ``roundpipe.distributed.ProcessGroup`` (rank 0's parameters, buffers and
      seed are copied here; ``step`` combines the processes' gradients);
      ``gradient_reduction``: ``"sum"`` (default) or ``"mean"``.
    - ``overlap_iterations``: ``forward_backward`` returns at its losses while
      its backward stages still run (default ``True``, bitwise the same
      results); ``False``: every call returns when it has ended.
    - ``sync_warmup_steps``: the first n steps run synchronously before the
      one-step delay starts (default: ``set_sync_warmup_steps``'s, 0).

    As a module, the wrapped model is its submodule ``model``: parameters,
    buffers and state dict keys are the wrapped model's under ``model.``, and
    forward hooks run around the whole pipelined call. Attribute reads, writes
    and deletes that RoundPipe does not define fall through to the wrapped
    model (or to the one given to set_original_model).
    """

    _OWN = frozenset(("model", "name", "_engine", "_original", "_layers", "_layer_prefixes",
                      "_optim_dtype", "_run_config", "_optim_by_master", "_process_group",
                      "_gradient_reduction", "_pin_model", "_default_merge", "_overlap_iterations",
                      "_sync_warmup_steps", "_warned_small_batch", "_tile_settings", "_memory_layers"))

    def __init__(self, model: nn.Module, optim_dtype: Optional[torch.dtype] = None, name: Optional[str] = None,
                 model_run_config: Optional[RoundPipeRunConfig] = None, pin_model: str = "alloc",
                 process_group: Any = None, gradient_reduction: str = "sum", overlap_iterations: bool = True,
                 sync_warmup_steps: Optional[int] = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"RoundPipe: model must be a torch.nn.Module, got {type(model).__name__}")
        if optim_dtype is not None and not isinstance(optim_dtype, torch.dtype):
            raise TypeError(f"RoundPipe: optim_dtype must be a torch.dtype or None, got {optim_dtype!r}")
        # Types are checked here; values once, by the engine (RoundPipeOptions).
        if not isinstance(pin_model, str):
            raise TypeError(f"RoundPipe: pin_model must be one of {_PIN_MODES}, got {pin_model!r}")
        if process_group is not None and not isinstance(process_group, _C.ProcessGroup):
            from .distributed import _from_torch_group
            converted = _from_torch_group(process_group)
            if converted is None:
                raise TypeError("RoundPipe: process_group must be a torch.distributed ProcessGroup (e.g. "
                                "torch.distributed.group.WORLD after init_process_group), a "
                                "roundpipe.distributed.ProcessGroup, or None; got "
                                f"{type(process_group).__name__}")
            process_group = converted
        if not isinstance(gradient_reduction, str):
            raise TypeError(f"RoundPipe: gradient_reduction must be 'sum' or 'mean', got {gradient_reduction!r}")
        if not isinstance(overlap_iterations, bool):
            raise TypeError(f"RoundPipe: overlap_iterations must be a bool, got {overlap_iterations!r}")
        if sync_warmup_steps is not None:
            if isinstance(sync_warmup_steps, bool) or not isinstance(sync_warmup_steps, int):
                raise TypeError(f"RoundPipe: sync_warmup_steps must be an int or None, got {sync_warmup_steps!r}")
        if model_run_config is None:
            model_run_config = RoundPipeRunConfig()
        if not isinstance(model_run_config, RoundPipeRunConfig):
            raise TypeError("RoundPipe: model_run_config must be a RoundPipeRunConfig")
        if name is None:
            name = _caller_name()
        nn.Module.__init__(self)
        own = self.__dict__
        self._modules["model"] = model
        own["name"] = str(name)
        own["_original"] = None
        own["_optim_dtype"] = optim_dtype
        own["_run_config"] = model_run_config
        own["_process_group"] = process_group
        own["_gradient_reduction"] = gradient_reduction
        own["_pin_model"] = pin_model
        own["_overlap_iterations"] = overlap_iterations
        own["_sync_warmup_steps"] = sync_warmup_steps
        if isinstance(model, nn.Sequential):
            if len(model) == 0:
                raise ValueError("RoundPipe: the Sequential has no layers")
            items = list(model._modules.items())
            own["_layers"] = [m for _, m in items]
            own["_layer_prefixes"] = [k + "." for k, _ in items]
        else:
            own["_layers"] = [model]
            own["_layer_prefixes"] = [""]
        own["_tile_settings"] = [layer.tile_setting for layer in own["_layers"]
                                 if isinstance(getattr(layer, "tile_setting", None), SequenceTileSetting)]
        own["_memory_layers"] = None
        own["_engine"] = None
        self._build_engine()

    def _build_engine(self):
        own = self.__dict__
        own["_engine"] = _C.Engine(self._layers, self.name, self._optim_dtype, self._run_config,
                                   self._process_group, self._gradient_reduction, self._pin_model,
                                   self._overlap_iterations, self._sync_warmup_steps)
        _live_engines.add(self._engine)
        # Optimizer copy of each master parameter (for named access and ties).
        self.training = all(layer.training for layer in self._layers)
        by_master, pairs = {}, []
        for engine_name, copy in self._engine.optim_named_parameters():
            layer, _, rest = engine_name.partition(".")
            master = self._layers[int(layer)].get_parameter(rest)
            by_master[id(master)] = copy
            pairs.append((master, copy))
        own["_optim_by_master"] = by_master
        _optimizer_guard.register(self.name, pairs)

    # ---- calls -------------------------------------------------------------

    def forward(self, *args: Any, roundpipe_run_config: Optional[RoundPipeRunConfig] = None, **kwargs: Any) -> Any:
        """Splits the batch into microbatches, runs the pipeline, merges the
        outputs (on the CPU by default). With grad mode on, the outputs carry
        autograd history: ``loss.backward()`` runs the backward stages."""
        return self._engine.forward(args, kwargs, self._call_config(args, kwargs, roundpipe_run_config))

    def _call_config(self, args, kwargs, run_config):
        """The run config of a call: packed inputs get an explicit split
        (microbatch.py), and a batch smaller than num_microbatch is reduced
        here, with a warning once per model rather than at every call."""
        run_config = _with_packed_split(args, kwargs, run_config, self._run_config)
        if run_config is not None and not isinstance(run_config, RoundPipeRunConfig):
            return run_config  # the engine says what is wrong with it

        def field(name):
            value = getattr(run_config, name) if run_config is not None else None
            return value if value is not None else getattr(self._run_config, name)

        # The call's tile reaches the layers through their shared setting,
        # which the first layer reads when it runs: calls return after that
        # (their losses or merged outputs need every layer), except
        # forward(merge_output=False), whose first layer may read the next
        # call's tile (the same results, up to rounding).
        for setting in self._tile_settings:
            setting.value = field("sequence_tile")
        if field("split_input") is not None:
            return run_config  # the engine finds the batch size of a custom split
        n = field("num_microbatch") or self._engine.num_devices() + 1
        batch = _batch_size(args, kwargs)
        if batch is None or not 1 <= batch < n:
            return run_config
        warn_small_batch(self, n, batch)
        fields = {f: getattr(run_config, f) for f in _RUN_CONFIG_FIELDS} if run_config is not None else {}
        return RoundPipeRunConfig(**{**fields, "num_microbatch": batch})

    def set_memory_model(self, layers: Optional[Sequence[Any]]) -> None:
        """The model's layers as roundpipe.memory sees them (a LayerMemory
        per layer; None: none): ``forward_backward`` then checks each call
        against its memory budget (RoundPipeRunConfig.memory_budget)."""
        from .memory import LayerMemory
        if layers is not None:
            layers = list(layers)
            if len(layers) != len(self._layers) or not all(isinstance(m, LayerMemory) for m in layers):
                raise ValueError(f"set_memory_model: needs one roundpipe.memory.LayerMemory per layer "
                                 f"({len(self._layers)}), got {len(layers)} values")
        self.__dict__["_memory_layers"] = layers

    def _check_memory_budget(self, args, kwargs, run_config):
        from .memory_budget import check_memory_budget

        def field(name):
            value = getattr(run_config, name, None) if run_config is not None else None
            return value if value is not None else getattr(self._run_config, name, None)

        floating = [p for layer in self._layers for p in layer.parameters() if p.is_floating_point()]
        element_size = floating[0].element_size() if floating else 4
        tile = check_memory_budget(self._memory_layers, field, self._engine.num_devices(),
                                   lambda: self._engine.default_execute_plan("fused"), args, kwargs, element_size)
        if tile is not None:
            for setting in self._tile_settings:
                setting.value = tile

    def forward_backward(self, input_args: Sequence[Any] = (), input_kwargs: Optional[Dict[str, Any]] = None,
                         label: Any = None, loss_fn: Callable[[Any, Any], Any] = _default_loss_fn,
                         return_outputs: bool = False, run_config: Optional[RoundPipeRunConfig] = None) -> Any:
        """Forward and backward fused in one pipeline; exactly::

            for args_m, kwargs_m, label_m in split(input_args, input_kwargs, label):
                loss_m = loss_fn(model(*args_m, **kwargs_m), label_m)
                torch.autograd.backward(loss_m)

        Returns the sum of the microbatch losses (CPU, detached; a list of sums
        if loss_fn returns a sequence), and the merged outputs as well when
        ``return_outputs``. The backward pass has run: the loss is for
        logging (its ``backward()`` is an error), and grad mode must be on."""
        check_grad_mode("RoundPipe")
        if isinstance(input_args, list):
            input_args = tuple(input_args)
        if not isinstance(input_args, tuple):
            raise TypeError(f"forward_backward: input_args must be a tuple, got {type(input_args).__name__}"
                            " (pass input_args=(x,) for one input)")
        if input_kwargs is None:
            input_kwargs = {}
        if not isinstance(input_kwargs, dict):
            raise TypeError(f"forward_backward: input_kwargs must be a dict, got {type(input_kwargs).__name__}")
        if not callable(loss_fn):
            raise TypeError("forward_backward: loss_fn must be callable")
        run_config = self._call_config(input_args, input_kwargs, run_config)
        if self._memory_layers is not None:
            self._check_memory_budget(input_args, input_kwargs, run_config)
        out = self._engine.forward_backward(input_args, input_kwargs, label, loss_fn, bool(return_outputs),
                                            run_config)
        return (_as_loss(out[0]), out[1]) if return_outputs else _as_loss(out)

    def step(self, step_fn: Callable[..., Any], is_async: bool = True, *args: Any, **kwargs: Any) -> None:
        """Queues on the optimizer thread: handing the gradients of every call
        so far to the optimizer copies' ``.grad``, then ``step_fn(*args,
        **kwargs)``. ``is_async=False`` waits, and later calls see the new
        parameters; ``is_async=True`` returns at once, and later calls see the
        parameters from before this step (one-step delay).

        Before any ``forward_backward`` (or when every gradient has been
        zeroed) ``step_fn`` runs with no gradients: optimizers skip the
        parameters whose ``.grad`` is None, as torch's do."""
        if not callable(step_fn):
            raise TypeError(f"step: step_fn must be callable, got {type(step_fn).__name__}")
        check_is_async(is_async)
        fn = functools.partial(step_fn, *args, **kwargs) if args or kwargs else step_fn
        if is_async:
            _check_no_torch_scaler(fn)
        self._engine.step(fn, is_async)

    def synchronize(self) -> None:
        """Waits for queued work; then the parameters hold the latest optimizer
        result and ``.grad`` the gradients not yet handed to an optimizer."""
        self._engine.synchronize()

    # ---- parameters --------------------------------------------------------

    def optim_named_parameters(self, prefix: str = "",
                               remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        """The optimizer copies, named like the model's parameters."""
        seen = set()
        for name, p in self._parameter_slots(prefix):
            if id(p) not in self._optim_by_master or (remove_duplicate and id(p) in seen):
                continue
            seen.add(id(p))
            yield name, self._optim_by_master[id(p)]

    def optim_parameters(self) -> Iterator[torch.Tensor]:
        """The optimizer copies: one per trainable parameter, tied ones once."""
        for _, p in self.optim_named_parameters():
            yield p

    def named_parameters(self, prefix: str = "", recurse: bool = True,  # type: ignore[override]
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        """The model's parameters; the optimizer copies inside an OptimizerCtx
        and inside a step_fn."""
        if _C.optimizer_ctx_active():
            return self.optim_named_parameters(prefix, remove_duplicate)
        self._engine.wait_published()  # not while an asynchronous step writes them
        return nn.Module.named_parameters(self, prefix=prefix, recurse=recurse,
                                          remove_duplicate=remove_duplicate)

    def _parameter_slots(self, prefix):
        """Every (name, parameter) slot of the model, tied ones in each place."""
        for mod_name, module in self.named_modules(remove_duplicate=False):
            for name, p in module._parameters.items():
                if p is not None:
                    full = f"{mod_name}.{name}" if mod_name else name
                    yield (f"{prefix}.{full}" if prefix else full), p

    def parameters(self, recurse: bool = True) -> Iterator[torch.Tensor]:  # type: ignore[override]
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        """The model's buffers as the latest call left them (a call still
        running is waited for)."""
        self._engine.wait_published()
        return nn.Module.named_buffers(self, prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    # ---- module behaviour --------------------------------------------------

    def train(self, mode: bool = True) -> "RoundPipe":
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        nn.Module.train(self, mode)
        if self.__dict__.get("_original") is not None:
            self.__dict__["_original"].train(mode)
        self._engine.train(mode)
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """The state dict (the wrapped model's under ``model.``) as the latest
        step published it (after an asynchronous step: the parameters from
        before it; call synchronize() first for the latest optimizer result)."""
        self._engine.wait_published()
        return nn.Module.state_dict(self, *args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Loads into the wrapped model's tensors (in place) and refreshes the
        optimizer copies, so the next step does not undo the load."""
        if assign:
            raise ValueError("RoundPipe.load_state_dict: assign=True would replace the tensors the engine "
                             "holds; load in place (assign=False)")
        self.synchronize()
        others = [self.model]
        if self.__dict__.get("_original") is not None:
            others.append(self.__dict__["_original"])  # a Hugging Face model's own keys
        result = load_into_matching(self, others, state_dict, strict)
        self._engine.refresh_optimizer_copies()
        return result

    def to(self, *args: Any, **kwargs: Any) -> "RoundPipe":
        """``to(dtype)`` converts the model's floating-point tensors and rebuilds
        the pipeline (and its optimizer copies: create optimizers afterwards).
        Devices: the model stays on the CPU (ValueError otherwise)."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"RoundPipe keeps the model on the CPU (the devices get copies of each stage); "
                             f"to({device}) is not supported")
        if dtype is None:
            return self
        self.synchronize()
        self._engine.close()
        self.model.to(dtype)
        self._build_engine()
        return self

    def _apply(self, fn, recurse=True):
        raise TypeError("RoundPipe keeps the model in host memory and gives the devices copies of each "
                        "stage: it cannot be moved or converted tensor by tensor. Use .to(dtype) "
                        "(or .half(), .float(), .bfloat16(), .double()) to change the dtype")

    def half(self) -> "RoundPipe":
        return self.to(torch.float16)

    def float(self) -> "RoundPipe":
        return self.to(torch.float32)

    def double(self) -> "RoundPipe":
        return self.to(torch.float64)

    def bfloat16(self) -> "RoundPipe":
        return self.to(torch.bfloat16)

    def cpu(self) -> "RoundPipe":
        return self

    def cuda(self, device: Any = None) -> "RoundPipe":
        return self.to("cuda" if device is None else device)

    def set_original_model(self, model: nn.Module) -> None:
        """Attribute access falls through to ``model`` instead of the wrapped one."""
        self.__dict__["_original"] = model

    def num_devices(self) -> int:
        return self._engine.num_devices()

    @property
    def timer(self) -> "ModelTimer":
        """This model's per-layer timing estimates (roundpipe.timer.ModelTimer)."""
        from .timer import ModelTimer
        return ModelTimer(self)

    def default_execute_plan(self, run_type: str) -> Any:
        """The plan a call of ``run_type`` ("infer", "train", "fused") uses when
        its run config has none: the automatic plan over the timer's estimates,
        kept until a new one is predicted at least 20% faster."""
        return self._engine.default_execute_plan(run_type)

    # ---- attribute fall-through -------------------------------------------

    def _target(self):
        own = self.__dict__
        return own["_original"] if own.get("_original") is not None else own["_modules"]["model"]

    def _is_own(self, name):
        return name in RoundPipe._OWN or name in self.__dict__ or hasattr(type(self), name)

    def __getattr__(self, name):
        own = self.__dict__
        if "model" not in own.get("_modules", ()):
            raise AttributeError(name)
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            return getattr(self._target(), name)

    def __setattr__(self, name, value):
        if name == "model":
            raise AttributeError("RoundPipe.model cannot be replaced: wrap the new model in a new RoundPipe")
        if self._is_own(name):
            nn.Module.__setattr__(self, name, value)
        else:
            setattr(self._target(), name, value)

    def __delattr__(self, name):
        if self._is_own(name):
            nn.Module.__delattr__(self, name)
        else:
            delattr(self._target(), name)

    def __repr__(self):
        return f"RoundPipe(name={self.name!r}, layers={len(self._layers)}, model={self.model!r})"
