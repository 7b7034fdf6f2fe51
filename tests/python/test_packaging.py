"""The package as pip installs it: one version, the torch it was built for
recorded and checked at import (a clear error naming both torches and how to
rebuild), the minimum torch enforced."""
import os
import re
import subprocess
import sys

import torch

import roundpipe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def import_with_torch_version(version):
    code = f"import torch\ntorch.__version__ = {version!r}\nimport roundpipe\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_version_comes_from_the_project():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        declared = re.search(r"project\(roundpipe VERSION ([0-9.]+)", f.read()).group(1)
    assert roundpipe.__version__ == declared
    from importlib.metadata import version
    assert version("roundpipe") == declared  # the installed distribution's metadata


def test_the_engine_records_the_torch_it_was_built_for():
    from roundpipe import _build_config
    assert _build_config.torch_version == torch.__version__


def test_another_torch_is_refused_with_a_clear_message():
    done = import_with_torch_version("2.9.1+cpu")
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError:"), done.stderr[-2000:]
    assert f"built for torch {torch.__version__}" in message and "torch 2.9.1+cpu is installed" in message
    assert "pip install --no-build-isolation --force-reinstall" in message


def test_torch_older_than_the_minimum_is_refused():
    done = import_with_torch_version("2.3.1")
    assert done.returncode != 0
    assert "roundpipe needs torch >= 2.4, but torch 2.3.1 is installed" in done.stderr, done.stderr[-2000:]


def package_imports():
    """{module: modules of the package it imports}, from the sources (imports
    inside functions count: they are dependencies all the same)."""
    import ast
    base = os.path.join(ROOT, "python")
    graph = {}
    for folder, _, files in os.walk(os.path.join(base, "roundpipe")):
        for file in files:
            if not file.endswith(".py"):
                continue
            parts = os.path.relpath(os.path.join(folder, file), base)[:-3].split(os.sep)
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            package = name if is_package else name.rpartition(".")[0]
            deps = set()
            with open(os.path.join(folder, file)) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    target = f"{anchor}.{node.module}" if node.module else anchor
                    deps.add(target)
                    deps.update(f"{target}.{a.name}" for a in node.names)
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("roundpipe"):
                    deps.add(node.module)
                elif isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names if a.name.startswith("roundpipe"))
            graph[name] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_the_package_has_no_import_circles():
    graph = package_imports()
    assert graph["roundpipe.auto"] >= {"roundpipe._model", "roundpipe.hf", "roundpipe.microbatch"}
    # The package's __init__ imports its modules; none of them imports it back.
    graph = {m: deps - {"roundpipe"} for m, deps in graph.items() if m != "roundpipe"}
    state = {}

    def visit(module, path):
        state[module] = "open"
        for dep in sorted(graph[module]):
            assert state.get(dep) != "open", "import circle: " + " -> ".join(path + [module, dep])
            if dep not in state:
                visit(dep, path + [module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
