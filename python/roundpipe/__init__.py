"""roundpipe: train models whose training state is far larger than one GPU's
memory, on one or more GPUs, at close to the GPUs' compute speed.

The model stays in host memory; its layers run as a pipeline of stages handed
round-robin to the devices; the optimizer runs on the CPU one step behind.
See docs/guide.md.
"""
import os as _os
import pkgutil as _pkgutil

# The compiled engine (roundpipe._C) lives in the build tree's copy of this
# package directory; both directories together form the package.
__path__ = _pkgutil.extend_path(__path__, __name__)
if _os.environ.get("ROUNDPIPE_EXTENSION_DIR"):
    __path__.append(_os.path.join(_os.environ["ROUNDPIPE_EXTENSION_DIR"], "roundpipe"))

import torch as _torch  # loads libtorch and its Python bindings before the engine

from . import _C
from . import data, distributed, microbatch, optim, presets, safetensors, timer, trace
from .checkpoint import load_checkpoint, save_checkpoint
from ._model import RoundPipe
from .grad_scaler import GradScaler  # noqa: F401
from .optimizer_ctx import OptimizerCtx
from .plan import ModelExecutePlan
from .recompute import doing_recompute, get_recompute_data, save_for_recompute
from .run_config import RoundPipeRunConfig

__version__ = "0.1.0"


def get_num_devices() -> int:
    """Number of devices of the pool (fixed at first use; see ROUNDPIPE_DEVICES)."""
    return _C.get_num_devices()


def set_sync_warmup_steps(n: int) -> None:
    """Run the first ``n`` steps of every model synchronously before the
    one-step delay starts (default 0)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"set_sync_warmup_steps: n must be an int, got {type(n).__name__}")
    _C.set_sync_warmup_steps(n)


__all__ = [
    "RoundPipe", "RoundPipeRunConfig", "ModelExecutePlan", "OptimizerCtx", "GradScaler",
    "save_for_recompute", "doing_recompute", "get_recompute_data", "get_num_devices",
    "set_sync_warmup_steps", "save_checkpoint", "load_checkpoint",
    "data", "distributed", "microbatch", "optim", "presets", "safetensors", "timer", "trace",
]
