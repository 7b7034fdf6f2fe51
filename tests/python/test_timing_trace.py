"""Per-layer timing (roundpipe.timer), automatic plans from timings, and
timeline traces of real runs (roundpipe.trace)."""
import json
import os
import re
import subprocess

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe.timer import ModelTimer, save_timings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINE = re.compile(r"^Layer (\d+) (fwd|re|bwd)  new record: (\d+\.\d{3}) ms  new estimate: (\d+\.\d{3}) ms$")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def train(model, calls, **config):
    cfg = RoundPipeRunConfig(num_microbatch=2, **config)
    for _ in range(calls):
        x, y = torch.randn(4, 8), torch.randn(4, 2)
        model.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.mse_loss, run_config=cfg)
    model.synchronize()  # the timings of a call are recorded once it has ended


def test_verbose_prints_one_line_per_layer_and_action(capfd):
    model = RoundPipe(mlp())
    plan = ModelExecutePlan([range(0, 2)], [range(2, 5), range(0, 2)])
    assert not ModelTimer.VERBOSE
    ModelTimer.VERBOSE = True
    try:
        assert ModelTimer.VERBOSE
        train(model, 1, execute_plan=plan)  # first records are discarded: silent
        assert capfd.readouterr().err == ""
        train(model, 1, execute_plan=plan)
        lines = capfd.readouterr().err.splitlines()
    finally:
        ModelTimer.VERBOSE = False
    seen = set()
    for line in lines:
        m = LINE.match(line)
        assert m, f"unexpected line {line!r}"
        seen.add((int(m.group(1)), m.group(2)))
    # Layers 0-1 run forward, then recompute + backward; 2-4 are the fused stage.
    want = {(l, "fwd") for l in range(5)} | {(l, "bwd") for l in range(5)} | {(0, "re"), (1, "re")}
    assert seen == want
    # The first kept record is the estimate.
    for line in lines:
        m = LINE.match(line)
        assert m.group(3) == m.group(4)


def test_timer_estimates_and_planning_from_timings(tmp_path):
    model = RoundPipe(mlp())
    timer = model.timer
    assert timer.estimate(0, "fwd") is None
    train(model, 3)
    est = timer.estimates()
    assert all(v is not None and v >= 0 for v in est["fwd"]), est
    assert all(v is not None and v >= 0 for v in est["bwd"]), est
    assert timer.num_records(0, "fwd") == 2
    with pytest.raises(ValueError, match="action must be"):
        timer.estimate(0, "forward")
    # ModelExecutePlan.auto plans chained models jointly from their timings.
    other = RoundPipe(mlp())
    plans = ModelExecutePlan.auto("fused", model, other, min_stages=2)
    assert len(plans) == 2
    for plan in plans:
        assert plan.bwd_plan[0].stop == 5 and plan.bwd_plan[-1].start == 0
    single = ModelExecutePlan.auto("train", model)
    assert isinstance(single, ModelExecutePlan)
    with pytest.raises(ValueError, match="run_type"):
        ModelExecutePlan.auto("both", model)
    with pytest.raises(ValueError, match="model_memory_limit"):
        ModelExecutePlan.auto("train", model, model_memory_limit=0)
    # Asking again without new timings gives the same plan (the hysteresis
    # rule itself is tested in C++: AutoPlan.*).
    first = model.default_execute_plan("fused")
    assert model.default_execute_plan("fused") == first
    timer.reset()
    assert timer.estimate(0, "fwd") is None

    # Timings files feed the simulator.
    path = tmp_path / "timings.json"
    save_timings(path, model, other)
    data = json.loads(path.read_text())
    assert data["format"] == "roundpipe-timings-1"
    assert [m["timed"] for m in data["models"]] == [False, False]  # model was reset, other never ran
    assert len(data["models"][0]["layers"]) == 5
    sim = os.path.join(ROOT, "build", "roundpipe-sim")
    if os.path.exists(sim):
        out = subprocess.run([sim, "--timings", str(path), "--devices", "1,2"], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "speedup" in out.stdout


def test_trace_of_a_real_run(tmp_path):
    path = tmp_path / "run.json"
    model = RoundPipe(mlp(), name="traced")
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.1)

    def step():
        opt.step()
        opt.zero_grad()

    with roundpipe.trace.trace(path):
        assert roundpipe.trace.tracing()
        for _ in range(2):
            train(model, 1)
            model.step(step)
        model.synchronize()
    assert not roundpipe.trace.tracing()
    events = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    kinds = {e["cat"] for e in complete}
    assert {"compute", "upload", "optimizer"} <= kinds
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"param upload", "act upload", "compute", "download", "optimizer"} <= names
    for e in complete:
        if e["cat"] == "compute":
            assert e["args"]["model"] == "traced"
            assert re.match(r"(fwd|fused|bwd) s\d+ mb\d+$", e["name"])
    # The SVG renderer reads it.
    svg = tmp_path / "run.svg"
    out = subprocess.run([os.path.join(ROOT, "scripts", "trace-svg"), str(path), "-o", str(svg)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert svg.read_text().startswith("<?xml") or "<svg" in svg.read_text()[:200]


def test_trace_environment_variable_writes_at_exit(tmp_path):
    path = tmp_path / "env.json"
    script = (
        "import torch, roundpipe\n"
        "m = roundpipe.RoundPipe(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)))\n"
        "m.forward_backward(input_args=(torch.randn(4, 4),), label=torch.randn(4, 1),\n"
        "                   loss_fn=torch.nn.functional.mse_loss)\n"
    )
    env = dict(os.environ, ROUNDPIPE_TRACE=str(path), ROUNDPIPE_DEVICES="cpu:2")
    out = subprocess.run([os.sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    events = json.loads(path.read_text())["traceEvents"]
    devices = {e["pid"] for e in events if e["ph"] == "X" and e["cat"] == "compute"}
    assert devices == {1, 2}
