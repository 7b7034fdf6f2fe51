"""Runs a check script in processes of their own, one per device count
(ROUNDPIPE_DEVICES=cpu:N; the device pool is fixed at first use), and
gathers the JSON report each prints as its last line."""
import json
import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))


def device_reports(tmp_path_factory, name, script, args=(), counts=(1, 3), timeout=900):
    """{N: report} for each N in ``counts``. ``script`` is formatted with
    ``tests`` (this folder, for imports); a failing run fails the caller
    with the end of its stderr."""
    path = tmp_path_factory.mktemp(name) / "check.py"
    path.write_text(script.format(tests=TESTS))
    out = {}
    for n in counts:
        env = dict(os.environ, ROUNDPIPE_DEVICES=f"cpu:{n}")
        done = subprocess.run([sys.executable, str(path), *args], env=env, timeout=timeout, capture_output=True,
                              text=True)
        assert done.returncode == 0, f"the check on {n} device(s) failed:\n{done.stderr[-4000:]}"
        out[n] = json.loads(done.stdout.strip().splitlines()[-1])
    return out
