"""RoundPipeRunConfig: per-model and per-call settings (docs/guide.md, "4. Run options")."""
from typing import Any, Optional

_FIELDS = ("num_microbatch", "recompute_grain", "output_device", "preserve_rng_state",
           "requires_grad", "split_input", "split_label", "merge_output", "execute_plan", "sequence_tile",
           "memory_budget")


# The engine counts microbatches in 64-bit integers; no batch comes near this.
_MAX_MICROBATCHES = 2**31 - 1


class RoundPipeRunConfig:
    """Settings of a call. Every field defaults to None = inherit: a call's
    config overrides the model's (``model_run_config``), which overrides the
    built-in defaults:

    - ``num_microbatch``: number of devices + 1 (reduced, with a warning, to a
      smaller batch size).
    - ``recompute_grain``: ``"stage"`` or ``"layer"`` (lower peak device memory).
    - ``output_device``: the CPU; a device keeps outputs there.
    - ``preserve_rng_state``: True.
    - ``requires_grad``: ``torch.is_grad_enabled()``.
    - ``split_input``: ``(args_spec, kwargs_spec)`` or a function
      ``(args, kwargs, n) -> (args_list, kwargs_list)``; automatic otherwise.
    - ``split_label``: a spec or a function ``(label, n) -> list``.
    - ``merge_output``: a spec, a function ``(outputs) -> merged``, or False
      (per-microbatch values for chaining models).
    - ``execute_plan``: a ModelExecutePlan.
    - ``sequence_tile``: tokens per tile of the sequence in which the Hugging
      Face presets' decoder blocks run their MLP and norms (an int >= 1; at
      least the sequence length: untiled); automatic by default
      (roundpipe.tiling.auto_sequence_tile: untiled unless one tile's MLP
      intermediates would pass 256 MiB). No effect on other layers.
    - ``memory_budget``: bytes a call may hold on one device (an int >= 1).
      A Hugging Face decoder wrapped by ``wrap_model_to_roundpipe`` checks
      its ``forward_backward`` against it before the call starts
      (roundpipe.memory): one predicted to pass it raises ValueError with
      the longest sequence that fits. Default: a GPU's memory less 10 %;
      unchecked on CPU devices.
    """

    __slots__ = _FIELDS

    def __init__(self, num_microbatch: Optional[int] = None, recompute_grain: Optional[str] = None,
                 output_device: Any = None, preserve_rng_state: Optional[bool] = None,
                 requires_grad: Optional[bool] = None, split_input: Any = None, split_label: Any = None,
                 merge_output: Any = None, execute_plan: Any = None, sequence_tile: Optional[int] = None,
                 memory_budget: Optional[int] = None) -> None:
        if num_microbatch is not None:
            if isinstance(num_microbatch, bool) or not isinstance(num_microbatch, int):
                raise TypeError(f"num_microbatch must be an int, got {type(num_microbatch).__name__}")
            if not 1 <= num_microbatch <= _MAX_MICROBATCHES:
                raise ValueError(f"num_microbatch must be from 1 to {_MAX_MICROBATCHES}, got {num_microbatch}")
        if recompute_grain not in (None, "stage", "layer"):
            raise ValueError(f"recompute_grain must be 'stage' or 'layer', got {recompute_grain!r}")
        for name, value in (("preserve_rng_state", preserve_rng_state), ("requires_grad", requires_grad)):
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool or None, got {type(value).__name__}")
        if sequence_tile is not None:
            if isinstance(sequence_tile, bool) or not isinstance(sequence_tile, int):
                raise TypeError(f"sequence_tile must be an int (tokens per tile) or None (automatic), got "
                                f"{type(sequence_tile).__name__} {sequence_tile!r}")
            if sequence_tile < 1:
                raise ValueError(f"sequence_tile must be >= 1 token per tile, got {sequence_tile}; "
                                 "use None for the automatic tile")
        if memory_budget is not None:
            if isinstance(memory_budget, bool) or not isinstance(memory_budget, int):
                raise TypeError(f"memory_budget must be an int (bytes per device) or None, got "
                                f"{type(memory_budget).__name__} {memory_budget!r}")
            if memory_budget < 1:
                raise ValueError(f"memory_budget must be >= 1 byte, got {memory_budget}")
        if execute_plan is not None and not (hasattr(execute_plan, "fwd_plan") and hasattr(execute_plan, "bwd_plan")):
            raise TypeError(f"execute_plan must be a roundpipe.ModelExecutePlan, got {type(execute_plan).__name__}")
        self.num_microbatch = num_microbatch
        self.recompute_grain = recompute_grain
        self.output_device = output_device
        self.preserve_rng_state = preserve_rng_state
        self.requires_grad = requires_grad
        self.split_input = split_input
        self.split_label = split_label
        self.merge_output = merge_output
        self.execute_plan = execute_plan
        self.sequence_tile = sequence_tile
        self.memory_budget = memory_budget

    def __repr__(self):
        set_fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in _FIELDS if getattr(self, f) is not None)
        return f"RoundPipeRunConfig({set_fields})"
