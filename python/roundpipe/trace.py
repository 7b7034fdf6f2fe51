"""Timeline traces of real runs: every job's uploads, compute per (stage,
microbatch), activation hand-offs and downloads on each device, and every
optimizer step, as a Chrome trace JSON (open it in https://ui.perfetto.dev or
chrome://tracing; ``scripts/trace-svg`` renders an SVG). Setting
``ROUNDPIPE_TRACE=<file>`` traces the whole process. See docs/trace.md.
"""
import contextlib
import os
from typing import Iterator, Union

from . import _C

PathLike = Union[str, "os.PathLike[str]"]


def start_trace(path: PathLike) -> None:
    """Starts recording (process-wide), to be written to ``path`` by
    ``stop_trace()`` or at exit. A trace already being recorded is written first."""
    _C.start_trace(str(path))


def stop_trace() -> None:
    """Writes the trace (atomically) and stops recording; no-op when not tracing."""
    _C.stop_trace()


def tracing() -> bool:
    """Whether a trace is being recorded."""
    return _C.tracing()


@contextlib.contextmanager
def trace(path: PathLike) -> Iterator[None]:
    """``with roundpipe.trace.trace("run.json"): ...`` records the block."""
    start_trace(path)
    try:
        yield
    finally:
        stop_trace()
