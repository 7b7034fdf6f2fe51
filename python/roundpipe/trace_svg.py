"""Render a Chrome trace (JSON "Trace Event Format") as a standalone SVG timeline.

Usage::

    python -m roundpipe.trace_svg TRACE.json -o OUT.svg [--width N] [--title T]
                                  [--from-ms A] [--to-ms B]

Input: a trace as roundpipe writes it (see src/schedule/chrome_trace.h: one process
per device plus "host", one thread per lane, complete events whose "cat" is
the kind of work) or any other Chrome trace: a top-level list of events or an
object with a "traceEvents" list; "X" (complete) events and "B"/"E" pairs on
the same thread; "M" metadata (process_name, thread_name, process_sort_index,
thread_sort_index) where present. Other phases are ignored; a "B" without
its "E" is dropped. A gzip-compressed file is read too.

Output: one row per (process, thread) that has events, in the trace's sort
order (sort index, then id), labelled "<process name> <thread name>"
(e.g. "cpu:0 compute"; "pid N" / "tid M" where metadata is missing). Bars are
coloured by kind: compute by job (forward, fused, backward), and upload,
download, handoff, optimizer and any other category each in their own colour.
Every bar carries a <title> tooltip (name, times, category, args); bars wide
enough show a short label. Times are in milliseconds from the trace's first
event; the axis ticks are 1, 2 or 5 times a power of ten.

Only the standard library is used.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import sys
import zlib
from xml.sax.saxutils import escape

# Known kinds, in legend order: (colour key, legend label, fill colour).
KINDS = [
    ("forward", "compute: forward", "#4e8fd6"),
    ("fused", "compute: fused", "#9b72cf"),
    ("backward", "compute: backward", "#f28e2b"),
    ("compute", "compute", "#76b7b2"),
    ("upload", "upload", "#59a14f"),
    ("download", "download", "#e15759"),
    ("handoff", "handoff", "#edc948"),
    ("optimizer", "optimizer", "#9c755f"),
    ("wait", "wait: parameter gate", "#d7d7d7"),
]
_KNOWN = {key: (label, color) for key, label, color in KINDS}
# Colours for other categories, assigned in sorted order of their names.
_EXTRA_COLORS = ["#bab0ac", "#ff9da7", "#b07aa1", "#86bcb6", "#d4a6c8", "#a0cbe8", "#ffbe7d", "#8cd17d"]

ROW_H, BAR_H = 22, 16          # row pitch and bar height, px
MIN_PX = 1.0                   # bars narrower than this are merged (see _row_bars)
MERGE_PX = 3.0                 # the widest a merged bar grows
LABEL_CHAR_W, BAR_CHAR_W = 7.0, 6.0   # approximate glyph widths of 12 px and 10 px text
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _esc(text) -> str:
    """`text` as XML character data or attribute value: escaped, with the
    characters XML 1.0 forbids removed."""
    return escape(_XML_INVALID.sub("", str(text)), {'"': "&quot;"})


def _num(value):
    """`value` as a finite float, or None."""
    if isinstance(value, bool):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _id(value):
    """A pid/tid usable as a dict key: numbers and strings as they are."""
    return value if isinstance(value, (int, float, str)) and not isinstance(value, bool) else str(value)


def _sort_key(value):
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))


def _kind(cat: str, args: dict) -> str:
    """Colour key of an event: its job for compute, else its category."""
    if cat == "compute" and args.get("job") in ("forward", "fused", "backward"):
        return args["job"]
    return cat or "(no category)"


def parse_trace(trace):
    """Rows of a trace: a list of (pid, label, events) in display order,
    where events are (ts_us, dur_us, name, cat, args) tuples sorted by start.
    Raises ValueError when the trace has no complete events."""
    if isinstance(trace, dict):
        events = trace.get("traceEvents")
        if not isinstance(events, list):
            raise ValueError("the trace has no 'traceEvents' list")
    elif isinstance(trace, list):
        events = trace
    else:
        raise ValueError("a trace is a JSON object with 'traceEvents' or a list of events")
    pnames, tnames, psort, tsort, rows, open_ = {}, {}, {}, {}, {}, {}
    for e in events:
        if not isinstance(e, dict):
            continue
        ph = e.get("ph")
        pid, tid = _id(e.get("pid", 0)), _id(e.get("tid", 0))
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        if ph == "M":
            name, value = e.get("name"), args.get("name")
            if name == "process_name" and value is not None:
                pnames[pid] = str(value)
            elif name == "thread_name" and value is not None:
                tnames[(pid, tid)] = str(value)
            elif name == "process_sort_index" and _num(args.get("sort_index")) is not None:
                psort[pid] = _num(args.get("sort_index"))
            elif name == "thread_sort_index" and _num(args.get("sort_index")) is not None:
                tsort[(pid, tid)] = _num(args.get("sort_index"))
            continue
        ts = _num(e.get("ts"))
        if ts is None or ph not in ("X", "B", "E"):
            continue
        if ph == "X":
            dur = max(_num(e.get("dur")) or 0.0, 0.0)
            rows.setdefault((pid, tid), []).append((ts, dur, str(e.get("name", "")), str(e.get("cat", "")), args))
        elif ph == "B":
            open_.setdefault((pid, tid), []).append((ts, e, args))
        elif open_.get((pid, tid)):
            b_ts, b, b_args = open_[(pid, tid)].pop()
            name, cat = b.get("name", e.get("name", "")), b.get("cat", e.get("cat", ""))
            rows.setdefault((pid, tid), []).append((b_ts, max(ts - b_ts, 0.0), str(name), str(cat),
                                                     {**b_args, **args}))
    if not rows:
        raise ValueError("the trace has no complete events ('ph': 'X', or 'B'/'E' pairs)")

    def order(row):
        pid, tid = row
        return (_sort_key(psort.get(pid, pid)), _sort_key(pid), _sort_key(tsort.get(row, tid)), _sort_key(tid))

    out = []
    for row in sorted(rows, key=order):
        pid, tid = row
        label = f"{pnames.get(pid, f'pid {pid}')} {tnames.get(row, f'tid {tid}')}"
        out.append((pid, label, sorted(rows[row], key=lambda ev: ev[0])))
    return out


def _nice_step(span: float, target_ticks: float) -> float:
    """The step among 1, 2, 5 x 10^k closest above span / target_ticks."""
    raw = span / max(target_ticks, 1.0)
    base = 10.0 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw * 0.999)


def _ms(us: float) -> str:
    return f"{us / 1000:.3f} ms"


def _duration(us: float) -> str:
    return f"{us:.1f} \u00b5s" if us < 1000 else _ms(us)


def _tooltip(ev, t0: float) -> str:
    ts, dur, name, cat, args = ev
    when = f"{_ms(ts - t0)} \u2013 {_ms(ts - t0 + dur)} ({_duration(dur)})"
    lines = [name or "(unnamed)", f"{cat or 'no category'}: {when}"]
    for key, value in args.items():
        text = value if isinstance(value, str) else json.dumps(value)
        lines.append(f"{key}: {text[:200]}")
    return "\n".join(lines)


def _text_color(fill: str) -> str:
    r, g, b = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return "#000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#fff"


def _row_bars(events, t0, ws, we, px, kind_of):
    """Yields the bars of one row: ("bar", x0, x1, event) or
    ("merged", x0, x1, (count, {kind: total_us}, first_us, last_us)).

    Events of at least MIN_PX are drawn one by one. Narrower ones that start
    within MIN_PX of each other are merged into bars of at most MERGE_PX, so
    that a dense row (100k events) costs a bar per few pixels instead of one
    element per event; the caller colours a merged bar by the kind with most
    time in it and shades it by the fraction of its span that is busy."""
    group = None  # [x0, x1, first event, count, {kind: us}, first_us, last_us]

    def flush():
        if group is None:
            return None
        if group[3] == 1:
            return ("bar", group[0], group[1], group[2])
        return ("merged", group[0], group[1], (group[3], group[4], group[5], group[6]))

    for ev in events:
        s, e = ev[0] - t0, ev[0] - t0 + ev[1]
        if e < ws or s > we:
            continue
        x0, x1 = px(max(s, ws)), px(min(e, we))
        if x1 - x0 >= MIN_PX:
            done, group = flush(), None
            if done:
                yield done
            yield ("bar", x0, x1, ev)
        elif group is not None and x0 <= group[1] + MIN_PX and x1 - group[0] <= MERGE_PX:
            group[1] = max(group[1], x1)
            group[3] += 1
            kind = kind_of(ev)
            group[4][kind] = group[4].get(kind, 0.0) + ev[1]
            group[6] = max(group[6], e)
        else:
            done = flush()
            if done:
                yield done
            group = [x0, x1, ev, 1, {kind_of(ev): ev[1]}, s, e]
    done = flush()
    if done:
        yield done


def render_svg(trace, *, width=1600, title=None, start_us=None, end_us=None) -> str:
    """The SVG text of `trace` (a parsed Chrome trace: dict or list), `width`
    px wide. `start_us`/`end_us` bound the window shown, in microseconds from
    the trace's first event (default: the whole trace); events crossing a bound
    are clipped, rows with no events in the window stay (empty) so that views
    of one trace line up. Raises ValueError for a trace without complete
    events or an empty window."""
    rows = parse_trace(trace)
    t0 = min(ev[0] for _, _, evs in rows for ev in evs)
    t_end = max(ev[0] + ev[1] for _, _, evs in rows for ev in evs) - t0
    ws = 0.0 if start_us is None else float(start_us)
    we = (t_end if t_end > ws else ws + 1.0) if end_us is None else float(end_us)
    if not we > ws:
        raise ValueError(f"empty time window: {ws / 1000:g} ms to {we / 1000:g} ms")
    width = max(int(width), 300)

    kinds_seen = {_kind(ev[3], ev[4]) for _, _, evs in rows for ev in evs}
    others = sorted(k for k in kinds_seen if k not in _KNOWN)
    colors = {k: c for k, (_, c) in _KNOWN.items()}
    colors.update({k: _EXTRA_COLORS[i % len(_EXTRA_COLORS)] for i, k in enumerate(others)})
    legend = [(k, lbl) for k, lbl, _ in KINDS if k in kinds_seen] + [(k, k) for k in others]

    label_w = min(max(len(lbl) for _, lbl, _ in rows) * LABEL_CHAR_W + 16, 320)
    plot_x, plot_w = label_w, width - label_w - 20
    scale = plot_w / (we - ws)

    def px(t):
        return plot_x + (t - ws) * scale

    def kind_of(ev):
        return _kind(ev[3], ev[4])

    out = []
    y = 8
    if title:
        out.append(f'<text x="10" y="{y + 18}" class="title">{_esc(title)}</text>')
        y += 30
    lx = 10  # legend, wrapped to the width
    for key, lbl in legend:
        item_w = 22 + len(lbl) * LABEL_CHAR_W + 14
        if lx + item_w > width and lx > 10:
            lx, y = 10, y + 18
        out.append(f'<rect x="{lx}" y="{y + 2}" width="14" height="12" fill="{colors[key]}" class="swatch"/>'
                   f'<text x="{lx + 20}" y="{y + 12}" class="legend">{_esc(lbl)}</text>')
        lx += item_w
    y += 22
    n_events = sum(len(evs) for _, _, evs in rows)
    caption = (f"{n_events} events in {len(rows)} rows; ms from the first event; "
               f"window {ws / 1000:g}\u2013{we / 1000:g} ms")
    caption_at = len(out)
    y += 18
    top, bottom = y, y + len(rows) * ROW_H

    out.append("<g class=\"rows\">")
    for i, (pid, label, _) in enumerate(rows):
        ry = top + i * ROW_H
        fill = "#f4f4f4" if i % 2 == 0 else "#ffffff"
        out.append(f'<rect x="0" y="{ry}" width="{width}" height="{ROW_H}" fill="{fill}"/>'
                   f'<text x="{label_w - 8}" y="{ry + ROW_H / 2 + 4}" class="row-label">{_esc(label)}</text>')
        if i and pid != rows[i - 1][0]:  # a line between processes
            out.append(f'<line x1="0" x2="{width}" y1="{ry}" y2="{ry}" stroke="#999" stroke-width="0.6"/>')
    out.append("</g>")

    # Time axis: ticks every 1/2/5 x 10^k ms, about one per 100 px.
    span_ms = (we - ws) / 1000
    step = _nice_step(span_ms, plot_w / 100)
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    out.append('<g class="axis">')
    out.append(f'<line x1="{plot_x}" x2="{plot_x + plot_w}" y1="{bottom}" y2="{bottom}" stroke="#333"/>')
    for k in range(math.ceil(ws / 1000 / step - 1e-6), math.floor(we / 1000 / step + 1e-6) + 1):
        x = px(k * step * 1000)
        out.append(f'<line x1="{x:.2f}" x2="{x:.2f}" y1="{top}" y2="{bottom + 5}" class="grid"/>'
                   f'<text x="{x:.2f}" y="{bottom + 18}" class="tick">{k * step:.{decimals}f}</text>')
    out.append(f'<text x="{plot_x + plot_w}" y="{bottom + 34}" class="axis-title">time (ms)</text></g>')

    merged = 0
    out.append('<g class="bars">')
    for i, (_, _, evs) in enumerate(rows):
        by = top + i * ROW_H + (ROW_H - BAR_H) / 2
        for what, x0, x1, data in _row_bars(evs, t0, ws, we, px, kind_of):
            w = max(x1 - x0, MIN_PX)
            if what == "merged":
                merged += 1
                count, per_kind, first, last = data
                kind = max(per_kind, key=per_kind.get)
                busy = min(sum(per_kind.values()) / max(last - first, 1e-9), 1.0)
                parts = ", ".join(f"{k}: {v / 1000:.3f} ms" for k, v in sorted(per_kind.items()))
                tip = (f"{count} events merged (each under {MIN_PX:g} px)\n"
                       f"{_ms(first)} \u2013 {_ms(last)}, {busy:.0%} busy\n{parts}")
                out.append(f'<rect x="{x0:.2f}" y="{by}" width="{w:.2f}" height="{BAR_H}" fill="{colors[kind]}" '
                           f'fill-opacity="{max(busy, 0.25):.2f}" class="bar merged" data-kind="{_esc(kind)}" '
                           f'data-count="{count}">'
                           f'<title>{_esc(tip)}</title></rect>')
                continue
            kind = kind_of(data)
            out.append(f'<rect x="{x0:.2f}" y="{by}" width="{w:.2f}" height="{BAR_H}" fill="{colors[kind]}" '
                       f'class="bar" data-kind="{_esc(kind)}"><title>{_esc(_tooltip(data, t0))}</title></rect>')
            name, fits = data[2], int((w - 6) / BAR_CHAR_W)
            if name and fits >= 3:
                short = name if len(name) <= fits else name[:fits - 1] + "\u2026"
                out.append(f'<text x="{x0 + 3:.2f}" y="{by + BAR_H - 4}" fill="{_text_color(colors[kind])}" '
                           f'class="bar-label">{_esc(short)}</text>')
    out.append("</g>")
    if merged:
        caption += f"; {merged} bars merge events under {MIN_PX:g} px"
    out.insert(caption_at, f'<text x="10" y="{top - 8}" class="caption">{_esc(caption)}</text>')

    height = bottom + 44
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">\n'
            f'<title>{_esc(title or "trace timeline")}</title>\n'
            '<style>.title{font-size:16px;font-weight:bold}.caption{fill:#555;font-size:11px}'
            '.row-label{text-anchor:end}.tick{text-anchor:middle;font-size:11px}'
            '.axis-title{text-anchor:end;font-size:11px}.grid{stroke:#ccc;stroke-width:0.5}'
            '.bar-label{font-size:10px;pointer-events:none}</style>\n'
            f'<rect width="{width}" height="{height}" fill="#fff"/>\n')
    return head + "\n".join(out) + "\n</svg>\n"


def load_trace(path: str):
    """The parsed JSON of the trace file at `path` (gzip or plain). Raises
    OSError or ValueError."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return json.loads(data.decode("utf-8"))


def main(argv=None) -> int:
    """Command line: renders TRACE to OUT (default: TRACE with .svg). Exits
    with status 2 and a message on stderr for an unreadable file, invalid
    JSON, a trace without complete events or a bad window."""
    parser = argparse.ArgumentParser(prog="trace-svg", description="Render a Chrome trace as an SVG timeline.")
    parser.add_argument("trace", help="trace JSON file (Chrome Trace Event Format)")
    parser.add_argument("-o", "--output", help="SVG file to write (default: TRACE with .svg)")
    parser.add_argument("--width", type=int, default=1600, help="image width in px (default 1600)")
    parser.add_argument("--title", help="title line (default: the trace's file name)")
    parser.add_argument("--from-ms", type=float, help="window start, ms from the first event")
    parser.add_argument("--to-ms", type=float, help="window end, ms from the first event")
    args = parser.parse_args(argv)

    def fail(message):
        print(f"trace-svg: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    try:
        trace = load_trace(args.trace)
    except OSError as e:
        fail(f"cannot read {args.trace}: {e.strerror or e}")
    except (ValueError, EOFError, zlib.error) as e:  # bad JSON, UTF-8 or gzip data
        fail(f"{args.trace} is not valid trace JSON: {e}")
    try:
        svg = render_svg(trace, width=args.width, title=args.title or os.path.basename(args.trace),
                         start_us=None if args.from_ms is None else args.from_ms * 1000,
                         end_us=None if args.to_ms is None else args.to_ms * 1000)
    except ValueError as e:
        fail(f"{args.trace}: {e}")
    output = args.output or os.path.splitext(args.trace)[0] + ".svg"
    try:
        with open(output, "w", encoding="utf-8") as f:
            f.write(svg)
    except OSError as e:
        fail(f"cannot write {output}: {e.strerror or e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
