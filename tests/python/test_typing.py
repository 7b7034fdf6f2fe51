"""The package is typed (it ships py.typed): every public Python function and
method has annotations on each parameter and its return, and the compiled
engine's stub (_C.pyi) names everything the extension defines (scripts/test
also runs mypy's stubtest on it)."""
import ast
import importlib
import inspect
import os

import roundpipe

MODULES = ["roundpipe", "roundpipe.auto", "roundpipe.checkpoint", "roundpipe.data", "roundpipe.device",
           "roundpipe.distributed", "roundpipe.grad_scaler", "roundpipe.hf_generic", "roundpipe.microbatch", "roundpipe.optim",
           "roundpipe.optimizer_ctx", "roundpipe.optimizer_state", "roundpipe.plan", "roundpipe.presets",
           "roundpipe.recompute", "roundpipe.run_config", "roundpipe.safetensors", "roundpipe.timer",
           "roundpipe.trace", "roundpipe.models.function", "roundpipe.integrations.transformers"]


def public_callables():
    seen = set()
    for name in MODULES:
        module = importlib.import_module(name)
        names = getattr(module, "__all__", None)
        if names is None:  # what the module defines, not what it imports
            names = [n for n, v in vars(module).items()
                     if not n.startswith("_") and getattr(v, "__module__", None) == name]
        for attr in names:
            obj = getattr(module, attr)
            if inspect.ismodule(obj) or not getattr(obj, "__module__", "").startswith("roundpipe."):
                continue
            if obj.__module__ == "roundpipe._C" or id(obj) in seen:
                continue  # the engine's own: typed by _C.pyi
            seen.add(id(obj))
            if inspect.isclass(obj):
                for member, value in vars(obj).items():
                    if member.startswith("_") and member not in ("__init__", "__call__"):
                        continue
                    if isinstance(value, property):
                        yield f"{obj.__module__}.{obj.__qualname__}.{member}", value.fget
                    elif isinstance(value, (staticmethod, classmethod)):
                        yield f"{obj.__module__}.{obj.__qualname__}.{member}", value.__func__
                    elif inspect.isfunction(value):
                        yield f"{obj.__module__}.{obj.__qualname__}.{member}", value
            elif inspect.isfunction(obj):
                yield f"{obj.__module__}.{obj.__qualname__}", obj


def test_every_public_signature_is_annotated():
    missing = []
    for name, fn in public_callables():
        signature = inspect.signature(fn)
        params = [p for i, p in enumerate(signature.parameters.values())
                  if not (i == 0 and p.name in ("self", "cls"))]
        unannotated = [p.name for p in params if p.annotation is inspect.Parameter.empty]
        if signature.return_annotation is inspect.Signature.empty:
            unannotated.append("return")
        if unannotated:
            missing.append(f"{name}: {', '.join(unannotated)}")
    assert not missing, "not annotated:\n" + "\n".join(missing)


def stub_names(node):
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.ClassDef)):
            names.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    return names


def test_the_engine_stub_names_what_the_extension_defines():
    """Names and members; scripts/test runs mypy's stubtest, which checks the
    stub against the extension in full."""
    from roundpipe import _C
    with open(os.path.join(os.path.dirname(roundpipe.__file__), "_C.pyi"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    runtime = {n for n in dir(_C) if not n.startswith("__")}
    stub = stub_names(tree) - {"_Pybind11Type"}
    assert runtime - stub == set(), f"defined by the extension, missing from _C.pyi: {sorted(runtime - stub)}"
    assert stub - runtime == set(), f"in _C.pyi, not defined by the extension: {sorted(stub - runtime)}"
    for cls in (item for item in tree.body if isinstance(item, ast.ClassDef) and item.name in runtime):
        members = {n for n in dir(getattr(_C, cls.name)) if not n.startswith("_")}
        missing = members - stub_names(cls)
        assert not missing, f"_C.{cls.name}: members missing from _C.pyi: {sorted(missing)}"
