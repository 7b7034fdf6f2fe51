"""roundpipe: train models whose training state is far larger than one GPU's
memory, on one or more GPUs, at close to the GPUs' compute speed.

The model stays in host memory; its layers run as a pipeline of stages handed
round-robin to the devices; the optimizer runs on the CPU one step behind.
See docs/guide.md.
"""
import torch as _torch  # loads libtorch and its Python bindings before the engine

from . import _build_config


def _check_torch():
    """The engine is compiled against one torch: refuse any other, clearly."""
    built, found = _build_config.torch_version, _torch.__version__
    base = lambda v: v.split("+")[0]  # noqa: E731
    if tuple(int(x) for x in base(found).split(".")[:2]) < (2, 4):
        raise ImportError(f"roundpipe needs torch >= 2.4, but torch {found} is installed; "
                          "upgrade it: pip install 'torch>=2.4'")
    same = found == built if "+" in built else base(found) == base(built)
    if not same:
        raise ImportError(
            f"roundpipe's engine (roundpipe._C) was built for torch {built}, but torch {found} is "
            "installed. Rebuild roundpipe against this torch: in its source directory run "
            "`pip install --no-build-isolation --force-reinstall .` (or scripts/build).")


_check_torch()

from . import _C  # noqa: E402
from . import _layers, _values, plan as _plan  # noqa: E402

# What the engine calls back into (it imports no module of the package).
_C._register_helpers(_layers.LayerAdapter, _values.flatten_node, _values.unflatten_node, _plan.ModelExecutePlan)

from . import data, device, distributed, memory, microbatch, optim, presets, safetensors, timer, trace
from .checkpoint import load_checkpoint, save_checkpoint
from ._model import RoundPipe
from .auto import AutoRoundPipe, WrapPathWarning
from .auto import wrap_model_to_roundpipe
from .grad_scaler import GradScaler  # noqa: F401
from .optimizer_ctx import OptimizerCtx
from .plan import ModelExecutePlan
from .recompute import doing_recompute, get_recompute_data, save_for_recompute
from .run_config import RoundPipeRunConfig

__version__ = _build_config.version


def get_num_devices() -> int:
    """Number of devices of the pool (fixed at first use; see ROUNDPIPE_DEVICES)."""
    return _C.get_num_devices()


def set_sync_warmup_steps(n: int) -> None:
    """Deprecated: ``RoundPipe(..., sync_warmup_steps=n)`` is the per-model
    setting. The default of that keyword for models built afterwards: their
    first ``n`` steps run synchronously before the one-step delay starts
    (default 0)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"set_sync_warmup_steps: n must be an int, got {type(n).__name__}")
    _C.set_sync_warmup_steps(n)


__all__ = [
    "RoundPipe", "AutoRoundPipe", "WrapPathWarning", "wrap_model_to_roundpipe", "RoundPipeRunConfig", "ModelExecutePlan", "OptimizerCtx", "GradScaler",
    "save_for_recompute", "doing_recompute", "get_recompute_data", "get_num_devices",
    "set_sync_warmup_steps", "save_checkpoint", "load_checkpoint",
    "data", "distributed", "microbatch", "optim", "presets", "safetensors", "timer", "trace",
]
