"""The engine's handle on one user layer (an ``nn.Module``).

Each device runs its own replica of the layer: a deep copy made without the
tensors' data (parameters and buffers are replaced by empty placeholders in
the copy), whose placeholders the engine points at the device tensors of each
job. Tied tensors stay tied in the replica (one placeholder for all slots).
"""
import contextlib
import copy
import threading

import torch

# torch.nn.utils.parametrize keeps one cache for the whole process, keyed by
# module, and switched on while any thread is inside its cached() context,
# which PEFT's LoRA on parameters (ParamWrapper, e.g. on a mixture of experts'
# stacked weights) enters on every forward. With another thread inside such a
# context (another device, or the caller's own PEFT model), a layer's entries
# outlive its call, and its recomputation would reuse a weight whose graph
# was already freed. So such layers take turns, and their entries are dropped
# before and after each call.
_PARAMETRIZE_LOCK = threading.Lock()


def _forget_cached(module_ids):
    from torch.nn.utils import parametrize
    cache = parametrize._cache
    for key in [k for k in list(cache) if k[0] in module_ids]:
        cache.pop(key, None)


def _uses_parametrize(module):
    from torch.nn.utils import parametrize
    return any(parametrize.is_parametrized(m) or type(m).__name__ == "ParamWrapper" for m in module.modules())


class LayerAdapter:
    def __init__(self, module, index):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"RoundPipe: layer {index} is a {type(module).__name__}, not a torch.nn.Module")
        self.module = module
        self.index = index
        self.type_name = type(module).__qualname__
        named_params = list(module.named_parameters())
        named_buffers = [(n, b) for n, b in module.named_buffers() if b is not None]
        for what, items in (("parameter", named_params), ("buffer", named_buffers)):
            for name, t in items:
                if t.device.type != "cpu":
                    raise ValueError(
                        f"RoundPipe: layer {index} ({self.type_name}) {what} '{name}' is on "
                        f"{t.device}; RoundPipe keeps the model on the CPU: move it there first")
        self.param_names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.buffer_names = [n for n, _ in named_buffers]
        self.buffers = [b for _, b in named_buffers]

    def make_replica(self):
        memo = {}
        for p in self.params:
            memo[id(p)] = torch.nn.Parameter(torch.empty(0, dtype=p.dtype),
                                             requires_grad=p.requires_grad)
        for b in self.buffers:
            memo[id(b)] = torch.empty(0, dtype=b.dtype)
        replica = copy.deepcopy(self.module, memo)
        return Replica(self.module, replica, self.param_names, self.buffer_names, _uses_parametrize(self.module))


class Replica:
    def __init__(self, master, module, param_names, buffer_names, serialized=False):
        self.module = module
        self.turns = _PARAMETRIZE_LOCK if serialized else contextlib.nullcontext()
        self.parametrized_ids = {id(m) for m in module.modules()} if serialized else None
        # The replica mirrors the master's training flags (set per submodule).
        self.pairs = list(zip(master.modules(), module.modules()))
        self.params = [module.get_parameter(n) for n in param_names]
        self.buffers = [module.get_buffer(n) for n in buffer_names]
        self.buffer_slots = []
        for name in buffer_names:
            owner, _, attr = name.rpartition(".")
            self.buffer_slots.append((module.get_submodule(owner) if owner else module, attr))

    def __call__(self, args, kwargs):
        for master, replica in self.pairs:
            replica.training = master.training
        with self.turns:
            if self.parametrized_ids is None:
                return self.module(*args, **kwargs)
            _forget_cached(self.parametrized_ids)
            try:
                return self.module(*args, **kwargs)
            finally:
                _forget_cached(self.parametrized_ids)

    def restore_buffers(self):
        """Puts the bound buffer variables back into the module's slots."""
        for (owner, attr), bound in zip(self.buffer_slots, self.buffers):
            owner._buffers[attr] = bound

    def take_buffers(self):
        """The buffers as the module holds them now; puts the bound ones back."""
        out = []
        for (owner, attr), bound in zip(self.buffer_slots, self.buffers):
            out.append(owner._buffers[attr])
            owner._buffers[attr] = bound
        return out
