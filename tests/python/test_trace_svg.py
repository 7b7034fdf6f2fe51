"""Tests of the trace-to-SVG renderer (python/roundpipe/trace_svg.py).

The package's __init__ loads torch and the compiled engine; the renderer needs
neither, so it is loaded here from its file."""
import importlib.util
import json
import os
import re
import subprocess
import time
import xml.etree.ElementTree as ET

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("trace_svg", os.path.join(ROOT, "python", "roundpipe", "trace_svg.py"))
trace_svg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_svg)

SVG = "{http://www.w3.org/2000/svg}"
LANES = ["param upload", "act upload", "compute", "download", "optimizer"]


def our_trace(events, devices=("cpu:0", "cpu:1")):
    """A trace laid out as src/schedule/chrome_trace.cpp writes it. `events` are
    (device, lane, kind, name, start_us, dur_us, args); device -1 is the host."""
    rows = {(d, lane) for d in range(len(devices)) for lane in range(4)}
    rows |= {(e[0], e[1]) for e in events}
    out, named = [], set()
    for device, lane in sorted(rows):
        pid = device + 1
        if pid not in named:
            named.add(pid)
            out.append({"ph": "M", "name": "process_name", "pid": pid,
                        "args": {"name": "host" if device < 0 else devices[device]}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": lane, "args": {"name": LANES[lane]}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": lane, "args": {"sort_index": lane}})
    for device, lane, kind, name, start, dur, args in events:
        out.append({"ph": "X", "name": name, "cat": kind, "pid": device + 1, "tid": lane, "ts": start, "dur": dur,
                    "args": args})
    return {"displayTimeUnit": "ms", "traceEvents": out}


def job(j, stage, mb):
    return {"model": "m", "call": 0, "job": j, "stage": stage, "layers": f"[{2 * stage}, {2 * stage + 2})",
            "microbatch": mb}


# One small step on two devices: every kind appears once or more.
EVENTS = [
    (0, 0, "upload", "params s0", 0.0, 100.0, {"model": "m", "stage": 0, "bytes": 4096}),
    (1, 0, "upload", "params s1", 50.0, 100.0, {"model": "m", "stage": 1, "bytes": 4096}),
    (0, 2, "compute", "fwd s0 mb0", 100.0, 400.0, job("forward", 0, 0)),
    (1, 1, "handoff", "act s0->s1 mb0", 500.0, 50.0, {"model": "m", "microbatch": 0, "bytes": 256}),
    (1, 2, "compute", "fused s1 mb0", 550.0, 800.0, job("fused", 1, 0)),
    (0, 2, "compute", "bwd s0 mb0", 1400.0, 600.0, job("backward", 0, 0)),
    (0, 3, "download", "grads s0", 2000.0, 150.0, {"model": "m", "stage": 0, "bytes": 4096}),
    (-1, 4, "optimizer", "step s0", 2150.0, 850.0, {"model": "m", "stage": 0}),
]


def parse(svg):
    return ET.fromstring(svg)


def bars(root):
    return [r for r in root.iter(SVG + "rect") if "bar" in r.get("class", "").split()]


def row_labels(root):
    return [t.text for t in root.iter(SVG + "text") if t.get("class") == "row-label"]


def title_of(el):
    return el.find(SVG + "title").text


def test_renders_valid_svg_with_one_row_per_lane_with_events():
    svg = trace_svg.render_svg(our_trace(EVENTS), title="step <1> & more")
    root = parse(svg)
    assert root.tag == SVG + "svg" and root.get("width") == "1600"
    # Sort order: host (pid 0) first, then devices by pid, lanes by index;
    # rows without events (named by the metadata only) are left out.
    assert row_labels(root) == ["host optimizer", "cpu:0 param upload", "cpu:0 compute", "cpu:0 download",
                                "cpu:1 param upload", "cpu:1 act upload", "cpu:1 compute"]
    assert any(t.text == "step <1> & more" for t in root.iter(SVG + "text"))
    assert len(bars(root)) == len(EVENTS)


def test_bar_geometry_is_proportional_to_time():
    root = parse(trace_svg.render_svg(our_trace(EVENTS), width=1200))
    by_name = {title_of(b).split("\n")[0]: b for b in bars(root)}
    x = {n: float(b.get("x")) for n, b in by_name.items()}
    w = {n: float(b.get("width")) for n, b in by_name.items()}
    px_per_us = (x["step s0"] - x["params s0"]) / 2150.0
    assert px_per_us > 0
    for _, _, _, name, start, dur, _ in EVENTS:
        assert x[name] == pytest.approx(x["params s0"] + start * px_per_us, abs=0.02)
        assert w[name] == pytest.approx(dur * px_per_us, abs=0.02)
    # The whole trace spans the plot: its last event ends at the right margin.
    assert x["step s0"] + w["step s0"] == pytest.approx(1200 - 20, abs=0.05)
    # Bars of a row sit inside that row: same y for the two compute bars of cpu:0.
    assert by_name["fwd s0 mb0"].get("y") == by_name["bwd s0 mb0"].get("y")
    assert by_name["fwd s0 mb0"].get("y") != by_name["fused s1 mb0"].get("y")


def test_colors_by_kind_and_tooltips():
    root = parse(trace_svg.render_svg(our_trace(EVENTS)))
    fill = {b.get("data-kind"): b.get("fill") for b in bars(root)}
    assert set(fill) == {"upload", "forward", "handoff", "fused", "backward", "download", "optimizer"}
    assert len(set(fill.values())) == len(fill)
    legend = [t.text for t in root.iter(SVG + "text") if t.get("class") == "legend"]
    assert legend == ["compute: forward", "compute: fused", "compute: backward", "upload", "download",
                      "handoff", "optimizer"]
    tips = [title_of(b) for b in bars(root)]
    fwd = next(t for t in tips if t.startswith("fwd s0 mb0"))
    assert "compute: 0.100 ms \u2013 0.500 ms (400.0 \u00b5s)" in fwd
    assert "job: forward" in fwd and "layers: [0, 2)" in fwd and "microbatch: 0" in fwd
    # Wide bars carry a short label; the 50 us handoff is too narrow for one.
    labels = [t.text for t in root.iter(SVG + "text") if t.get("class") == "bar-label"]
    assert "fused s1 mb0" in labels and "act s0->s1 mb0" not in labels


def test_time_axis_ticks_are_round_milliseconds():
    root = parse(trace_svg.render_svg(our_trace(EVENTS), width=1600))
    ticks = [t.text for t in root.iter(SVG + "text") if t.get("class") == "tick"]
    assert ticks[0] == "0.0" and ticks[-1] == "3.0"
    values = [float(t) for t in ticks]
    steps = {round(b - a, 6) for a, b in zip(values, values[1:])}
    assert len(steps) == 1 and steps.pop() in (0.1, 0.2, 0.5)
    assert 6 <= len(ticks) <= 31


def test_time_window_clips_bars():
    root = parse(trace_svg.render_svg(our_trace(EVENTS), width=1000, start_us=1000, end_us=2100))
    names = {title_of(b).split("\n")[0]: b for b in bars(root)}
    # fused (550-1350) and bwd, download (2000-2150), optimizer (starts 2150: outside).
    assert set(names) == {"fused s1 mb0", "bwd s0 mb0", "grads s0"}
    plot_x = float(names["bwd s0 mb0"].get("x")) - 400 * (1000 - 20 - float(names["bwd s0 mb0"].get("x"))) / 700
    fused, grads = names["fused s1 mb0"], names["grads s0"]
    assert float(fused.get("x")) == pytest.approx(plot_x, abs=0.05)  # clipped at the window start
    assert float(grads.get("x")) + float(grads.get("width")) == pytest.approx(1000 - 20, abs=0.05)
    # Rows stay put (all rows with events), so windows of one trace line up.
    assert len(row_labels(root)) == 7
    ticks = [float(t.text) for t in root.iter(SVG + "text") if t.get("class") == "tick"]
    assert min(ticks) >= 1.0 and max(ticks) <= 2.1
    with pytest.raises(ValueError, match="empty time window"):
        trace_svg.render_svg(our_trace(EVENTS), start_us=2000, end_us=1000)


def test_dense_rows_merge_sub_pixel_events_quickly():
    n = 100_000
    events = [(0, 2, "compute", f"fwd s0 mb{i}", i * 2.0, 1.0, job("forward", 0, i)) for i in range(n)]
    events += [(1, 0, "upload", "params", 0.0, 2.0 * n, {"bytes": 1})]
    trace = json.loads(json.dumps(our_trace(events)))
    t = time.perf_counter()
    svg = trace_svg.render_svg(trace, width=1600)
    assert time.perf_counter() - t < 10
    root = parse(svg)
    merged = [b for b in bars(root) if "merged" in b.get("class")]
    assert 0 < len(merged) <= 1600
    assert sum(int(b.get("data-count")) for b in merged) + len(bars(root)) - len(merged) - 1 == n
    assert all(b.get("data-kind") == "forward" for b in merged)
    assert "events merged" in title_of(merged[0])
    # Merged bars are at most a few pixels wide and shaded by how busy they
    # are: here 1 us of every 2 us.
    assert max(float(b.get("width")) for b in merged) <= 3.0 + 1e-6
    busy = [float(b.get("fill-opacity")) for b in merged if int(b.get("data-count")) > 10]
    assert busy and all(0.45 <= v <= 0.6 for v in busy)


def test_generic_chrome_trace():
    events = [
        {"ph": "B", "name": "outer", "pid": "renderer", "tid": 7, "ts": 1_000_000},
        {"ph": "B", "name": "inner <x>", "cat": "gpu", "pid": "renderer", "tid": 7, "ts": 1_000_100},
        {"ph": "E", "pid": "renderer", "tid": 7, "ts": 1_000_200, "args": {"result": [1, 2]}},
        {"ph": "E", "pid": "renderer", "tid": 7, "ts": 1_000_500},
        {"ph": "X", "name": "bad\x01name", "pid": 3, "tid": 1, "ts": 1_000_300, "dur": 100},
        {"ph": "M", "name": "thread_name", "pid": 3, "tid": 1, "args": {"name": "io"}},
        {"ph": "i", "name": "instant", "pid": 3, "tid": 1, "ts": 1_000_000},
        {"ph": "B", "name": "never ends", "pid": 3, "tid": 2, "ts": 1_000_000},
    ]
    root = parse(trace_svg.render_svg(events))
    assert row_labels(root) == ["pid 3 io", "pid renderer tid 7"]
    tips = sorted(title_of(b) for b in bars(root))
    assert len(tips) == 3
    assert tips[0].startswith("badname\nno category: 0.300 ms")
    assert tips[1].startswith("inner <x>\ngpu: 0.100 ms \u2013 0.200 ms") and "result: [1, 2]" in tips[1]
    assert tips[2].startswith("outer\n")
    fills = {b.get("data-kind"): b.get("fill") for b in bars(root)}
    assert len(set(fills.values())) == 2  # "gpu" and "(no category)"


def test_no_complete_events_is_an_error():
    with pytest.raises(ValueError, match="no complete events"):
        trace_svg.render_svg({"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "args": {}}]})
    with pytest.raises(ValueError, match="traceEvents"):
        trace_svg.render_svg({"events": []})


def test_cli_writes_svg(tmp_path):
    src = tmp_path / "step.json"
    src.write_text(json.dumps(our_trace(EVENTS)))
    out = tmp_path / "out.svg"
    assert trace_svg.main([str(src), "-o", str(out), "--width", "800", "--from-ms", "0.5", "--to-ms", "2"]) == 0
    root = ET.parse(out).getroot()
    assert root.get("width") == "800"
    assert any(t.text == "step.json" for t in root.iter(SVG + "text"))  # default title
    assert trace_svg.main([str(src)]) == 0 and (tmp_path / "step.svg").exists()


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ("{not json", "not valid trace JSON"),
    (json.dumps({"traceEvents": []}), "no complete events"),
])
def test_cli_errors(tmp_path, capsys, content, message):
    src = tmp_path / "t.json"
    if content is not None:
        src.write_text(content)
    with pytest.raises(SystemExit) as e:
        trace_svg.main([str(src), "-o", str(tmp_path / "o.svg")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("trace-svg: error:") and message in err and str(src) in err
    assert not (tmp_path / "o.svg").exists()


def test_wrapper_script(tmp_path):
    script = os.path.join(ROOT, "scripts", "trace-svg")
    assert os.access(script, os.X_OK)
    src = tmp_path / "t.json"
    src.write_text(json.dumps(our_trace(EVENTS)))
    done = subprocess.run([script, str(src), "-o", str(tmp_path / "t.svg"), "--title", "T"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.search(r"<title>T</title>", (tmp_path / "t.svg").read_text())
    bad = subprocess.run([script, str(tmp_path / "missing.json")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "cannot read" in bad.stderr
