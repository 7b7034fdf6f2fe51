"""Models without a preset (docs/hf.md, "Other models"): the module tree
split into pipelined parts by parameter size.

``AutoRoundPipe(model)``, which ``wrap_model_to_roundpipe(model)`` returns for
a model that has no preset and is not an ``nn.Sequential``, walks its module
tree. A submodule whose parameters take
between ``lower_threshold`` and ``upper_threshold`` bytes (default: the
model's size over the number of devices + 1) becomes a part: its own
RoundPipe, running the submodule as one layer. Larger submodules are split
into their children (an ``nn.ModuleList`` / ``nn.ModuleDict`` always is);
smaller ones, and parts whose parameters are shared with code outside them
(tied embeddings), stay where they are and run on the CPU in the calling
thread, with the model's own code between the parts. A model in which no
submodule qualifies (too small to split) is one part, whole.

The model is not rebuilt: every submodule keeps its place, name and tensors,
so ``state_dict`` and ``save_pretrained`` write the same keys as before.
During the AutoRoundPipe's own calls a part's submodule runs its pipeline,
as one microbatch; otherwise the model is left as it was (its ``generate``
runs transformers' code on the CPU, with the same weights). An
:class:`AutoRoundPipe` has
RoundPipe's calls (``forward``, ``forward_backward`` with the microbatch loop
of ``RoundPipe.forward_backward`` and RoundPipe's split and merge, ``step``,
``synchronize``, ``optim_parameters``, ``set_original_model``, attribute
fall-through to the model). Its asynchronous steps have RoundPipe's one-step
delay: one ``step_fn`` runs on the first part's optimizer thread once every
part has handed over its gradients, and each part takes the new values when
it has run. A model with trainable parameters between the parts steps
synchronously (once warned): those train in place on the calling thread.
"""
import contextlib
import functools
import inspect
import threading
import warnings
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from . import _C
from ._model import (RoundPipe, _as_loss, _caller_name, check_grad_mode, check_is_async, load_into_matching,
                     warn_small_batch)
from .grad_scaler import _check_no_torch_scaler
from .microbatch import _merge_auto, _split_auto
from .hf import _FAMILIES, _base_model, _family, merge_hf_outputs
from .hf_generic import GenericDecoderUnsupported, generic_layers, preset_layers
from .packed import pack_frozen_linears
from .memory_budget import hf_memory_model
from .run_config import _FIELDS as _RUN_CONFIG_FIELDS, RoundPipeRunConfig


class _Part(nn.Module):
    """What a part's pipeline runs: the submodule's own forward (the
    submodule's `forward` attribute is rerouted to the pipeline)."""

    def __init__(self, module):
        super().__init__()
        self.inner = module

    def forward(self, *args, **kwargs):
        return type(self.inner).forward(self.inner, *args, **kwargs)


def _param_bytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _plan_parts(model, lower, upper, skip):
    """Paths of the submodules that become parts (disjoint subtrees)."""
    parts = []

    def visit(module, path):
        if module in skip:
            return
        size = _param_bytes(module)
        container = isinstance(module, (nn.ModuleList, nn.ModuleDict))
        children = list(module.named_children())
        if not container and lower <= size <= upper and size > 0:
            parts.append(path)
        elif container or (size > upper and children):
            for name, child in children:
                visit(child, f"{path}.{name}" if path else name)
        elif size > upper and not container:
            parts.append(path)  # one large leaf: it cannot be split

    for name, child in model.named_children():
        visit(child, name)
    return _without_shared(model, parts)


def _without_shared(model, parts):
    """Drops parts whose parameters are also used outside them: a tensor
    must belong to one pipeline (or to the code between them)."""
    parts = list(parts)
    while True:
        owners = {}
        for mod_path, module in model.named_modules(remove_duplicate=False):
            for p in module._parameters.values():
                if p is None:
                    continue
                owner = next((q for q in parts if mod_path == q or mod_path.startswith(q + ".")), None)
                owners.setdefault(id(p), set()).add(owner)
        shared = {o for group in owners.values() if len(group) > 1 for o in group if o is not None}
        if not shared:
            return parts
        parts = [q for q in parts if q not in shared]


def _check_split_arguments(who, model, lower_threshold, upper_threshold, override_config):
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}: model must be a torch.nn.Module, got {type(model).__name__}")
    for what, value in (("lower_threshold", lower_threshold), ("upper_threshold", upper_threshold)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{who}: {what} must be an int >= 0, got {value!r}")
    if override_config is not None and not isinstance(override_config, dict):
        raise TypeError(f"{who}: override_config must be a dict {{module: RoundPipeRunConfig}}")


def _noop():
    pass


def _takes_use_cache(model):
    """Whether ``model`` is called with a key/value cache unless told not to
    (a transformers model whose config says ``use_cache``)."""
    if not getattr(getattr(model, "config", None), "use_cache", False):
        return False
    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _route_to(part):
    # A plain function: copying the submodule (for a device replica) keeps it
    # as it is instead of copying the pipeline it names.
    def forward(*args, **kwargs):
        return part(*args, **kwargs)
    return forward


def _part_config(override, config):
    """A part's run config: its override, else the model's, with one
    microbatch unless the override asks for more. The model's calls are its
    microbatches already (forward_backward splits the batch; a generation
    step's key/value cache must see the whole batch at once), and a part is
    one layer, which a finer split would not pipeline."""
    chosen = override if override is not None else config
    if not isinstance(chosen, RoundPipeRunConfig) or chosen is override and override.num_microbatch is not None:
        return chosen  # RoundPipe refuses a config of another type
    fields = {f: getattr(chosen, f) for f in _RUN_CONFIG_FIELDS}
    return RoundPipeRunConfig(**{**fields, "num_microbatch": 1})


class _Routing:
    """The parts' pipelines stand in for their submodules only during this
    model's own calls: the loaded model, called directly (``generate``), is
    left as it was and runs on the CPU with the same weights."""

    def __init__(self):
        self.lock = threading.Lock()
        self.depth = 0
        self.saved = []

    def enter(self, routes):
        with self.lock:
            if self.depth == 0:
                self.saved = [(module, module.__dict__.get("forward", _UNSET)) for module, _ in routes]
                for module, forward in routes:
                    module.__dict__["forward"] = forward
            self.depth += 1

    def exit(self):
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                for module, forward in self.saved:
                    if forward is _UNSET:
                        del module.__dict__["forward"]
                    else:
                        module.__dict__["forward"] = forward
                self.saved = []


_UNSET = object()


class AutoRoundPipe(nn.Module):
    """``model``'s module tree split into pipelined parts (module doc), for
    any model: presets are ``wrap_model_to_roundpipe``'s choice.

    ``lower_threshold``, ``upper_threshold``, ``skip_modules`` and
    ``override_config`` choose the parts (wrap_model_to_roundpipe); ``name``
    and ``model_run_config`` are the model's; the other keywords go to each
    part's RoundPipe (``optim_dtype``, ``pin_model``, ...)."""

    _OWN = frozenset(("model", "name", "_parts", "_part_paths", "_run_config", "_original", "_warned_async",
                      "_warned_small_batch", "_routes", "_routing"))

    def __init__(self, model: nn.Module, lower_threshold: int = 16 * 1024, upper_threshold: Optional[int] = None,
                 skip_modules: Iterable[nn.Module] = (),
                 override_config: Optional[Dict[nn.Module, RoundPipeRunConfig]] = None, name: Optional[str] = None,
                 model_run_config: Optional[RoundPipeRunConfig] = None, **roundpipe_kwargs: Any) -> None:
        _check_split_arguments("AutoRoundPipe", model, lower_threshold, upper_threshold, override_config)
        name = _caller_name() if name is None else str(name)
        config = model_run_config if model_run_config is not None else RoundPipeRunConfig()
        if not isinstance(config, RoundPipeRunConfig):
            raise TypeError("AutoRoundPipe: model_run_config must be a RoundPipeRunConfig")
        if upper_threshold is None:
            upper_threshold = max(1, _param_bytes(model) // (_C.get_num_devices() + 1))
        paths = _plan_parts(model, lower_threshold, upper_threshold, set(skip_modules))
        if not paths and model not in skip_modules and _param_bytes(model) > 0:
            paths = [""]  # too small to split: the whole model is one part
        if not paths:
            raise ValueError(f"AutoRoundPipe: no submodule of the {type(model).__name__} has between "
                             f"lower_threshold={lower_threshold} and upper_threshold={upper_threshold} bytes of "
                             "parameters that it does not share; lower the thresholds")
        nn.Module.__init__(self)
        own = self.__dict__
        self._modules["model"] = model
        own.update(name=name, _run_config=config, _original=None, _warned_async=False, _part_paths=paths,
                   _routing=_Routing())
        parts, routes = [], []
        for path in paths:
            module = model.get_submodule(path)
            part = RoundPipe(_Part(module), name=f"{name}.{path}" if path else name,
                             model_run_config=_part_config((override_config or {}).get(module), config),
                             **roundpipe_kwargs)
            parts.append(part)
            routes.append((module, _route_to(part)))
        own["_parts"] = parts
        own["_routes"] = routes
        self.training = model.training

    # ---- calls -------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own forward; each part's call runs its pipeline."""
        with self._routed():
            return self.model(*args, **kwargs)

    @contextlib.contextmanager
    def _routed(self):
        routing = self.__dict__["_routing"]
        routing.enter(self.__dict__["_routes"])
        try:
            yield
        finally:
            routing.exit()

    def forward_backward(self, input_args: Sequence[Any] = (), input_kwargs: Optional[Dict[str, Any]] = None,
                         label: Any = None, loss_fn: Callable[[Any, Any], Any] = lambda outputs, labels: outputs,
                         return_outputs: bool = False, run_config: Optional[RoundPipeRunConfig] = None) -> Any:
        """The loop of ``RoundPipe.forward_backward`` over microbatches of the
        whole model (automatic split; ``run_config`` may set num_microbatch
        only)."""
        if isinstance(input_args, list):
            input_args = tuple(input_args)
        if not isinstance(input_args, tuple):
            raise TypeError(f"forward_backward: input_args must be a tuple, got {type(input_args).__name__}")
        input_kwargs = {} if input_kwargs is None else input_kwargs
        if not isinstance(input_kwargs, dict):
            raise TypeError(f"forward_backward: input_kwargs must be a dict, got {type(input_kwargs).__name__}")
        if not callable(loss_fn):
            raise TypeError("forward_backward: loss_fn must be callable")
        check_grad_mode("AutoRoundPipe")
        if "use_cache" not in input_kwargs and _takes_use_cache(self.model):
            # Training keeps no key/value cache, as transformers' gradient
            # checkpointing decides: a part's recomputation would append to
            # the cache a second time.
            input_kwargs = {**input_kwargs, "use_cache": False}
        inputs, labels = _split_auto(input_args, input_kwargs, label, self._num_microbatch(run_config),
                                     warn=lambda n, batch: warn_small_batch(self, n, batch, stacklevel=5))
        total, outputs = None, []
        with self._routed():
            for (args_m, kwargs_m), label_m in zip(inputs, labels):
                out = self.model(*args_m, **kwargs_m)
                loss = loss_fn(out, label_m)
                losses = list(loss) if isinstance(loss, (list, tuple)) else [loss]
                torch.autograd.backward(losses)
                detached = [t.detach().cpu() for t in losses]
                total = detached if total is None else [a + b for a, b in zip(total, detached)]
                if return_outputs:
                    outputs.append(out)
        result = _as_loss(total if isinstance(loss, (list, tuple)) else total[0])
        return (result, _merge_auto(outputs)) if return_outputs else result

    def _num_microbatch(self, run_config):
        if run_config is not None:
            if not isinstance(run_config, RoundPipeRunConfig):
                raise TypeError("run_config must be a RoundPipeRunConfig")
            others = [f for f in ("split_input", "split_label", "merge_output", "execute_plan")
                      if getattr(run_config, f) is not None]
            if others:
                raise ValueError(f"AutoRoundPipe.forward_backward: run_config may set num_microbatch only, "
                                 f"not {others} (they apply to each part: set them in model_run_config)")
            if run_config.num_microbatch is not None:
                return run_config.num_microbatch
        if self._run_config.num_microbatch is not None:  # validated at construction
            return self._run_config.num_microbatch
        return _C.get_num_devices() + 1

    def step(self, step_fn: Callable[..., Any], is_async: bool = True, *args: Any, **kwargs: Any) -> None:
        """As ``RoundPipe.step``: every part hands its gradients to its
        optimizer copies, ``step_fn(*args, **kwargs)`` runs once, then every
        part takes the new values. ``is_async=False`` runs it here and waits;
        ``is_async=True`` runs it on the first part's optimizer thread (the
        other parts' optimizer threads wait for it) and returns at once, and
        later calls see the parameters from before this step (one-step
        delay)."""
        if not callable(step_fn):
            raise TypeError(f"step: step_fn must be callable, got {type(step_fn).__name__}")
        check_is_async(is_async)
        fn = functools.partial(step_fn, *args, **kwargs) if args or kwargs else step_fn
        if is_async and self._trained_in_place():
            if not self._warned_async:
                warnings.warn("AutoRoundPipe.step runs synchronously: parameters between the parts (trained in "
                              "place, on the calling thread) would change under the next call", stacklevel=2)
                self.__dict__["_warned_async"] = True
            is_async = False
        if not is_async:
            for part in self._parts:
                part.step(_noop, is_async=False)
            fn()
            for part in self._parts:
                part.step(_noop, is_async=False)  # no gradients left to hand over: writes the new values
            return
        _check_no_torch_scaler(fn)
        # Each part's optimizer thread hands over its gradients, meets the
        # others, and writes its values once the one step_fn has run.
        handed = threading.Barrier(len(self._parts))
        stepped = threading.Event()

        def run_step():
            try:
                handed.wait()
                fn()
            finally:
                stepped.set()

        def wait_for_step():
            handed.wait()
            stepped.wait()

        try:
            for i, part in enumerate(self._parts):
                part.step(run_step if i == 0 else wait_for_step, is_async=True)
        except BaseException:
            handed.abort()  # the parts already queued must not wait for the others
            stepped.set()
            raise

    def _trained_in_place(self):
        """Whether a trainable parameter lies between the parts."""
        by_master = self._owner_of()
        return any(p.requires_grad and id(p) not in by_master for p in nn.Module.parameters(self))

    def synchronize(self) -> None:
        for part in self._parts:
            part.synchronize()

    # ---- parameters --------------------------------------------------------

    def _owner_of(self):
        by_master = {}
        for part in self._parts:
            by_master.update(part._optim_by_master)
        return by_master

    def optim_named_parameters(self, prefix: str = "",
                               remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        """The optimizer copies of the parts' parameters, and the parameters
        between the parts themselves (they train in place), named as the
        model's parameters."""
        by_master = self._owner_of()
        seen = set()
        for name, p in nn.Module.named_parameters(self, prefix=prefix, remove_duplicate=False):
            if remove_duplicate and id(p) in seen:
                continue
            seen.add(id(p))
            if id(p) in by_master:
                yield name, by_master[id(p)]
            elif p.requires_grad:
                yield name, p

    def optim_parameters(self) -> Iterator[torch.Tensor]:
        for _, p in self.optim_named_parameters():
            yield p

    def named_parameters(self, prefix: str = "", recurse: bool = True,  # type: ignore[override]
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        if _C.optimizer_ctx_active():
            return self.optim_named_parameters(prefix, remove_duplicate)
        return nn.Module.named_parameters(self, prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[torch.Tensor]:  # type: ignore[override]
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def parts(self) -> List[RoundPipe]:
        """The RoundPipe of each part, in module order."""
        return list(self._parts)

    def train(self, mode: bool = True) -> "AutoRoundPipe":
        nn.Module.train(self, mode)
        for part in self._parts:
            part.train(mode)
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        self.synchronize()
        return nn.Module.state_dict(self, *args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Loads in place (this module's ``model.`` keys or the model's own)
        and refreshes the parts' optimizer copies."""
        if assign:
            raise ValueError("AutoRoundPipe.load_state_dict: assign=True would replace the tensors the parts hold")
        self.synchronize()
        result = load_into_matching(self, [self.model], state_dict, strict)
        for part in self._parts:
            part._engine.refresh_optimizer_copies()
        return result

    def _apply(self, fn, recurse=True):
        raise TypeError("AutoRoundPipe keeps the model in host memory: it cannot be moved or converted")

    # ---- attribute fall-through -------------------------------------------

    def set_original_model(self, model: nn.Module) -> None:
        """Attribute access falls through to ``model`` instead of the split one."""
        self.__dict__["_original"] = model

    def _target(self):
        own = self.__dict__
        return own["_original"] if own.get("_original") is not None else own["_modules"]["model"]

    def __getattr__(self, name):
        if "model" not in self.__dict__.get("_modules", ()):
            raise AttributeError(name)
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            return getattr(self._target(), name)

    def __setattr__(self, name, value):
        if name in AutoRoundPipe._OWN or name in self.__dict__ or hasattr(type(self), name):
            nn.Module.__setattr__(self, name, value)
        else:
            setattr(self._target(), name, value)

    def __repr__(self):
        return f"AutoRoundPipe(name={self.name!r}, parts={self._part_paths})"


class WrapPathWarning(UserWarning):
    """Which path ``wrap_model_to_roundpipe`` took for a model, and why."""


def _choose_layers(model, use_sequential_preset):
    """(layers or None, what was chosen and why)."""
    name = type(model).__name__
    if use_sequential_preset is False:
        return None, "use_sequential_preset=False"
    layers = preset_layers(model)
    if layers is not None:
        return layers, f"the {_family(model)} preset (the fused pipeline)"
    try:
        layers = generic_layers(model)
    except GenericDecoderUnsupported as e:
        if use_sequential_preset is True:
            raise NotImplementedError(f"wrap_model_to_roundpipe: no preset for {name}: {e}") from None
        return None, f"no preset: {e}"
    return layers, "the generic decoder preset (the fused pipeline)"


def wrap_model_to_roundpipe(model: nn.Module, use_sequential_preset: Optional[bool] = None,
                            lower_threshold: int = 16 * 1024, upper_threshold: Optional[int] = None,
                            skip_modules: Iterable[nn.Module] = (),
                            override_config: Optional[Dict[nn.Module, RoundPipeRunConfig]] = None,
                            frozen_weights: Optional[str] = None,
                            **roundpipe_kwargs: Any) -> Union[RoundPipe, "AutoRoundPipe"]:
    """A RoundPipe for ``model`` as it was loaded.

    - Hugging Face ``LlamaForCausalLM``, ``Qwen3ForCausalLM``,
      ``Qwen3MoeForCausalLM``, ``GptOssForCausalLM``: the preset (module doc).
    - Any other Hugging Face decoder-only causal LM whose decoder blocks are
      one ``nn.ModuleList``: the generic decoder preset (roundpipe.hf_generic).
      ``use_sequential_preset=False`` refuses the presets; ``True`` requires one.
    - An ``nn.Sequential``: each child is a layer.
    - Anything else: its module tree split into pipelined parts of between
      ``lower_threshold`` and ``upper_threshold`` bytes of parameters
      (default: the model's size / (devices + 1)), except ``skip_modules``;
      ``override_config`` maps a submodule to its part's run config. Returns
      ``AutoRoundPipe(model, ...)`` (roundpipe.auto).

    ``frozen_weights="nf4" | "fp4" | "int8"`` keeps every frozen
    ``nn.Linear`` weight (a LoRA model's base weights; not the LM head)
    packed in host memory, uploaded packed and dequantized on the device
    (roundpipe.packed), replacing those modules in place; bitsandbytes 4-bit
    linears are kept as they were loaded either way.

    A Hugging Face model gets one ``WrapPathWarning`` saying which of these
    it got and why. ``roundpipe_kwargs`` go to RoundPipe (``optim_dtype``,
    ``name``, ``model_run_config``, ``pin_model``, ``process_group``, ...).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap_model_to_roundpipe: model must be a torch.nn.Module, got {type(model).__name__}")
    if use_sequential_preset not in (None, True, False):
        raise TypeError(f"wrap_model_to_roundpipe: use_sequential_preset must be None, True or False, "
                        f"got {use_sequential_preset!r}")
    _check_split_arguments("wrap_model_to_roundpipe", model, lower_threshold, upper_threshold, override_config)
    roundpipe_kwargs.setdefault("name", _caller_name())
    get_head = getattr(_base_model(model), "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    pack_frozen_linears(model, frozen_weights, skip=(head,) if head is not None else ())
    is_hf = hasattr(_base_model(model), "config") and not isinstance(model, nn.Sequential)
    layers, why = _choose_layers(model, use_sequential_preset) if is_hf else (None, "")
    if layers is not None:
        config = roundpipe_kwargs.pop("model_run_config", None) or RoundPipeRunConfig()
        if not isinstance(config, RoundPipeRunConfig):
            raise TypeError("wrap_model_to_roundpipe: model_run_config must be a RoundPipeRunConfig")
        if config.merge_output is None:
            fields = {f: getattr(config, f) for f in _RUN_CONFIG_FIELDS}
            config = RoundPipeRunConfig(**{**fields, "merge_output": merge_hf_outputs})
        wrapped = RoundPipe(layers, model_run_config=config, **roundpipe_kwargs)
        wrapped.set_original_model(model)
        wrapped.set_memory_model(hf_memory_model(_base_model(model), len(layers)))
        warnings.warn(f"wrap_model_to_roundpipe: the {type(model).__name__} runs as {why}", WrapPathWarning,
                      stacklevel=2)
        return wrapped
    if use_sequential_preset is True:
        raise NotImplementedError(f"wrap_model_to_roundpipe: no preset for {type(model).__name__}; presets: "
                                  f"{', '.join(_FAMILIES)} and decoder-only Hugging Face causal LMs")
    if isinstance(model, nn.Sequential):
        return RoundPipe(model, **roundpipe_kwargs)
    wrapped = AutoRoundPipe(model, lower_threshold, upper_threshold, skip_modules, override_config,
                            **roundpipe_kwargs)
    if is_hf:
        warnings.warn(f"wrap_model_to_roundpipe: the {type(model).__name__} runs as an AutoRoundPipe (parts "
                      f"pipelined one after another, synchronous steps): {why}", WrapPathWarning, stacklevel=2)
    return wrapped
