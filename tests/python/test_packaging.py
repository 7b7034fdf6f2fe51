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
