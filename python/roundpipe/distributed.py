"""Data parallelism across processes and machines.

Each process runs a RoundPipe model on its own devices with its share of the
batch; give the model a process group and every ``step`` combines the
processes' gradients (on the optimizer thread, layer by layer, overlapped with
the hand-off) before ``step_fn``, so all processes apply the same update::

    group = roundpipe.distributed.init_process_group()   # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    model = RoundPipe(net, process_group=group)          # copies rank 0's weights and seed
    for x, y in my_share_of_the_data(group.rank, group.world_size):
        loss = model.forward_backward(x, label=y, loss_fn=loss_fn)
        model.step(step_fn)

Or use the processes' torch.distributed group, as DDP and FSDP do::

    torch.distributed.init_process_group("gloo")         # e.g. under torchrun
    model = RoundPipe(net, process_group=torch.distributed.group.WORLD)

With ``gradient_reduction="sum"`` (the default) gradients are summed over
processes, as they are over microbatches: W processes that each split their
share into M microbatches train exactly like one process running all W * M
microbatches of the concatenated batch (dropout included). ``"mean"`` divides
by the number of processes. Every process must use the same
``num_microbatch`` and issue the same sequence of steps.

Checkpoints: only rank 0 writes (call ``save_checkpoint`` after ``step`` on
every rank or on rank 0); every process loads the same file, on any number of
processes. A peer that dies or hangs makes the others fail with an error
naming the collective within ``timeout``; the group is unusable afterwards
(end the processes and resume from a checkpoint). Launch with ``torchrun``
or any launcher that sets the four variables (see docs/distributed.md).
"""
from datetime import timedelta
from typing import Optional, Union

from . import _C

ProcessGroup = _C.ProcessGroup
ProcessGroup.__doc__ = """Processes that run collectives together (c10d Gloo over TCP).

``rank``, ``world_size``, ``timeout_s``; ``all_reduce_sum(tensor, what)``
(in place), ``broadcast(tensor, root, what)``, ``barrier(what)`` on contiguous
CPU tensors. Called outside a ``step_fn``, these first wait for the model's
queued steps, so that they come after the same steps on every process."""


def _from_torch_group(group):
    """A roundpipe ProcessGroup over torch.distributed ``group`` (a c10d
    ProcessGroup: Gloo, or NCCL with host tensors staged through the current
    CUDA device), or None if ``group`` is not one."""
    import torch.distributed as dist
    if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_timeout
        timeout = _get_default_timeout(dist.get_backend(group)).total_seconds()
    except Exception:  # private helper moved: torch's documented default
        timeout = 30 * 60.0
    return _C.wrap_process_group(group, timeout)


def is_available() -> bool:
    """Whether this build has the c10d Gloo backend."""
    return _C.distributed_available()


def init_process_group(init_method: str = "env://", rank: Optional[int] = None, world_size: Optional[int] = None,
                       timeout: Union[timedelta, float] = timedelta(minutes=5)) -> "_C.ProcessGroup":
    """Meets the other processes and returns their ``ProcessGroup``.

    - ``init_method``: ``"env://"`` (``MASTER_ADDR``, ``MASTER_PORT``; rank 0
      hosts the store), ``"tcp://HOST:PORT"``, or ``"file:///PATH"`` (a file on
      a filesystem all processes share; it must not exist beforehand).
    - ``rank``, ``world_size``: default ``RANK`` and ``WORLD_SIZE``.
    - ``timeout``: a ``timedelta`` or seconds; how long meeting the peers and
      every collective may wait for a peer.

    One group serves one RoundPipe model; create one per model.
    """
    if not isinstance(init_method, str):
        raise TypeError(f"init_process_group: init_method must be a str, got {type(init_method).__name__}")
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"init_process_group: {name} must be an int or None, got {value!r}")
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"init_process_group: timeout must be a timedelta or seconds, got {timeout!r}")
    return _C.create_process_group(init_method, -1 if rank is None else rank,
                                   -1 if world_size is None else world_size, seconds)


__all__ = ["ProcessGroup", "init_process_group", "is_available"]
