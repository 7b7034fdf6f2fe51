"""The optimizer mistakes that would otherwise train nothing, silently, made
errors at the first step (docs/python.md, "Optimizers"): an optimizer built
over a model's own parameters (outside ``OptimizerCtx``) stepped inside
``model.step(...)``, and an optimizer over the optimizer copies stepped
outside ``model.step(...)``. The gradients reach the copies only inside a
step, so in both cases none of the model's tensors the optimizer holds has a
gradient: that is what is checked, exactly, by a global optimizer step hook.
"""
import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import _C

# id(tensor) -> (weak reference, model name, "master" or "copy"), for the
# trainable parameters of live models and their optimizer copies.
_known = {}


def register(model_name, masters_and_copies):
    """Records a model's (master, copy) pairs; forgotten with the tensors."""
    for master, copy in masters_and_copies:
        for tensor, kind in ((master, "master"), (copy, "copy")):
            key = id(tensor)
            _known[key] = (weakref.ref(tensor, lambda _, key=key: _known.pop(key, None)), model_name, kind)


def _owned(tensor):
    entry = _known.get(id(tensor))
    if entry is None or entry[0]() is not tensor:
        return None
    return entry


def _check_step(optimizer, args, kwargs):
    found = None
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _owned(p)
            if entry is None:
                continue
            if p.grad is not None:
                return  # something to do
            found = found or entry
    if found is None:
        return
    _, model, kind = found
    name = type(optimizer).__name__
    if kind == "master" and _C.on_optimizer_thread():
        raise RuntimeError(
            f"{name} holds the parameters of RoundPipe model '{model}', not its optimizer copies, so this "
            f"step would train nothing: build the optimizer inside `with roundpipe.OptimizerCtx():` "
            f"(model.parameters() then gives the copies) or over model.optim_parameters()")
    if kind == "copy" and not _C.on_optimizer_thread():
        raise RuntimeError(
            f"{name}.step() was called outside model.step(...): the gradients reach the optimizer copies "
            f"of RoundPipe model '{model}' only inside a step, so it would train nothing. Call it there: "
            f"model.step(lambda: (optimizer.step(), optimizer.zero_grad()))")


register_optimizer_step_pre_hook(_check_step)
