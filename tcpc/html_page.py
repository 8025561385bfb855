"""`tcpc run --html PAGE`: one run on one self-contained page, as a compiler explorer and a
profiler's annotated source would show it. Its sections:

- the run: program, passes, machine, totals, choices, outputs (`Page.facts`);
- the source: every line of the `.moe` program beside its commands, busy and critical-path
  cycles, bytes and FLOPs (`SimReport.lines`, the attribution `--report-by line` prints);
- the IR after every pass, collapsible, the passes that left it unchanged marked so
  (tcpc.pass_instruments.IRHistory, on the one per-pass hook);
- the report's tables (the text `--report` prints);
- the timeline: the Chrome trace's own events (`SimReport.trace_events`) drawn as SVG, an
  engine unit per row, a command per rect, its op, passes and source place in its tooltip;
  a run of more slices than `TIMELINE_RECTS` is drawn in equal intervals instead (`_binned`).

Everything is inline (CSS, SVG, one small script) and escaped: the page opens offline, and
reads without its script, which only records errors into the page (window.onerror), marks
that it loaded (`<html data-status="loaded">`) and lights a source line's rects on hover.
"""

from __future__ import annotations

import html
import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dialects.annotations import PHASES
from runtime_sim.perf.report import LineRecord, SimReport, file_line
from tcpc.pass_instruments import IRStep

TIMELINE_RECTS = 3000
"""The most rects the timeline draws. A run with more slices (a prefill layer has hundreds of
thousands) has each track cut into TIMELINE_RECTS // tracks equal intervals, an interval with
work one rect; the page says so."""

LABEL_WIDTH = 110
PLOT_WIDTH = 1000
ROW_HEIGHT = 14
ROW_GAP = 3
AXIS_HEIGHT = 22
MIN_RECT_WIDTH = 0.4
"""A command's rect is at least this wide (in SVG units), so that a short one still shows."""

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac")


@dataclass(frozen=True)
class Page:
    """What the page shows of one run."""

    title: str
    """The run's first line, as `tcpc run` prints it."""
    facts: Sequence[tuple[str, str]]
    """(what, text) rows of the header: the machine, the cycles, the choices, the outputs."""
    source_report: SimReport
    """The report whose by-line attribution the source shows (a mesh run's: one chip's)."""
    source_note: str
    """What the source's figures are of, when not plainly the run's (a mesh chip's)."""
    steps: Sequence[IRStep]
    pipeline: str
    report_text: str
    trace: Mapping[str, Any]
    """The Chrome trace `--trace` writes (SimReport.chrome_trace, MeshReport.chrome_trace)."""
    critical: Mapping[int, Collection[int]] = field(default_factory=dict)
    """Trace process id -> the keys of its commands on the critical path."""


def render(page: Page) -> str:
    """The page's HTML, every text from the run escaped."""
    files = _files(page.source_report)
    sections = [
        ("run", "Run", _facts(page)),
        ("source", "Source", _source(page.source_report, files, page.source_note)),
        ("passes", "IR after each pass", _passes(page.steps, page.pipeline)),
        ("report", "Report", f'<pre class="report">{_text(page.report_text)}</pre>'),
        ("timeline", "Timeline", timeline(page.trace, page.critical, files)),
    ]
    nav = " ".join(f'<a href="#{key}">{_e(title)}</a>' for key, title, _ in sections)
    body = "\n".join(f'<section id="{key}">\n<h2>{_e(title)}</h2>\n{content}\n</section>'
                     for key, title, content in sections)
    return (f'<!DOCTYPE html>\n<html lang="en" data-status="static">\n<head>\n<meta charset="utf-8">\n'
            f"<title>{_e(page.title)}</title>\n<script>{ERROR_SCRIPT}</script>\n<style>{STYLE}</style>\n</head>\n"
            f'<body>\n<ul id="page-errors"></ul>\n<header><h1>{_e(page.title)}</h1>\n<nav>{nav}</nav></header>\n'
            f"{body}\n<script>{PAGE_SCRIPT}</script>\n</body>\n</html>\n")


def _e(text: object) -> str:
    """`text` escaped for an element's content or a quoted attribute's value."""
    return html.escape(str(text), quote=True)


def _text(text: str) -> str:
    """`text` escaped for an element's content, quotes left as they are (IR is full of them)."""
    return html.escape(text, quote=False)


def _facts(page: Page) -> str:
    rows = "\n".join(f'<tr><th>{_e(what)}</th><td>{_e(text)}</td></tr>' for what, text in page.facts)
    return f'<table class="facts">\n{rows}\n</table>'


def _files(report: SimReport) -> dict[str, int]:
    """Each source file the page shows -> its number in the rects' `data-locs` (`0:12`): those
    whose text is known, then the others the commands are located in."""
    named = [*report.sources, *(r.file for r in report.lines if r.line)]
    return {file: i for i, file in enumerate(dict.fromkeys(named))}


def _source_lines(report: SimReport, file: str) -> list[str] | None:
    """The file's lines as written (without the empty one after a final newline), or None."""
    text = report.sources.get(file)
    if text is None:
        return None
    return text[:-1] if text and text[-1] == "" else list(text)


def _source(report: SimReport, files: Mapping[str, int], note: str) -> str:
    """Every line of every source file beside its figures: a table like `--report-by line`'s,
    the whole file rather than the costed lines' span, and a bar of each line's share."""
    records = report.lines
    total = report.total_cycles
    out = [f'<p class="note">{_e(note)}</p>' if note else "",
           '<p class="note">Each command counts on the line of its op (an op of several lines shares it '
           "equally); the critical-path column sums to the total cycles, busy to the engines' busy cycles.</p>"]
    if all(r.line == 0 for r in records):
        out.append('<p class="note">No op has a source location (IR without loc(...)).</p>')
    out.append('<table class="source">\n<thead><tr><th>line</th><th>commands</th><th>busy</th>'
               '<th>critical path</th><th>share</th><th>bytes</th><th>FLOPs</th><th class="code">source</th></tr>'
               "</thead>\n<tbody>")

    def row(number: str, loc: str, r: LineRecord | None, text: str, kind: str = "line") -> str:
        attrs = f' data-loc="{loc}"' if loc else ""
        code = f'<td class="code"><code>{_e(text)}</code></td>'
        if r is None:
            return f'<tr class="{kind}"{attrs}><td class="n">{number}</td>' + '<td></td>' * 6 + code + "</tr>"
        share = r.critical_cycles / total if total else 0.0
        return (f'<tr class="{kind} costed"{attrs}><td class="n">{number}</td><td class="commands">{r.commands:,}</td>'
                f'<td class="busy">{r.busy_cycles:,}</td><td class="critical">{r.critical_cycles:,}</td>'
                f'<td class="share"><span class="bar" style="width:{100 * share:.1f}%"></span>{share:.1%}</td>'
                f'<td class="bytes">{r.bytes:,}</td><td class="flops">{r.flops:,}</td>{code}</tr>')

    for file, index in files.items():
        mine = {r.line: r for r in records if r.file == file and r.line}
        lines = _source_lines(report, file)
        out.append(f'<tr class="file"><th colspan="8">{_e(file)}</th></tr>')
        numbers = range(1, len(lines) + 1) if lines is not None else sorted(mine)
        for n in numbers:
            text = lines[n - 1] if lines is not None and n <= len(lines) else ""
            out.append(row(str(n), f"{index}:{n}", mine.get(n), text))
    for r in records:
        if r.line == 0:
            out.append(row("-", "", r, "(commands without a source location)", "unlocated"))
    out.append("</tbody>")
    sums = [sum(getattr(r, f) for r in records) for f in ("commands", "busy_cycles", "critical_cycles", "bytes", "flops")]
    out.append(f'<tfoot><tr class="total"><th>total</th><td>{sums[0]:,}</td><td>{sums[1]:,}</td><td>{sums[2]:,}</td>'
               f'<td>{1.0 if total else 0.0:.1%}</td><td>{sums[3]:,}</td><td>{sums[4]:,}</td><td></td></tr></tfoot>')
    out.append("</table>")
    return "\n".join(part for part in out if part)


def _passes(steps: Sequence[IRStep], pipeline: str) -> str:
    """Each step's IR in a collapsed `<details>`, the last one open; a pass that changed
    nothing is one line, marked unchanged."""
    changed = sum(s.changed for s in steps if s.index)
    out = [f'<p class="note">Pipeline: <code>{_e(pipeline or "none (the IR as given)")}</code>; '
           f"{changed} of {max(len(steps) - 1, 0)} passes changed the IR (the others are marked unchanged). "
           "Op counts by dialect: the input's, then each pass's changes.</p>"]
    last = max((s.index for s in steps if s.changed), default=-1)
    for s in steps:
        badge = "" if s.index == 0 else f'<span class="badge">{"changed" if s.changed else "unchanged"}</span> '
        head = (f'<span class="index">{s.index:02d}</span> <span class="pass">{_e(s.name)}</span> {badge}'
                f'<span class="ops">{_e(s.ops)}</span>')
        if s.text is None:  # the IR is the previous step's
            out.append(f'<div class="step unchanged" id="step-{s.index}">{head}</div>')
            continue
        is_open = " open" if s.index == last else ""
        out.append(f'<details class="step changed" id="step-{s.index}"{is_open}><summary>{head}</summary>'
                   f'<pre class="ir">{_text(s.text)}</pre></details>')
    return "\n".join(out)


@dataclass
class _Track:
    pid: int
    tid: int
    name: str
    slices: list[Mapping[str, Any]] = field(default_factory=list)


def _tracks(events: Sequence[Mapping[str, Any]]) -> tuple[dict[int, str], list[_Track]]:
    """The trace's processes by id, and its named tracks in process and track order, each with
    its complete (`X`) events."""
    processes: dict[int, str] = {}
    tracks: dict[tuple[int, int], _Track] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = str(e["args"]["name"])
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            tracks[(e["pid"], e["tid"])] = _Track(e["pid"], e["tid"], str(e["args"]["name"]))
    for e in events:
        if e.get("ph") == "X":
            track = tracks.setdefault((e["pid"], e["tid"]), _Track(e["pid"], e["tid"], f"track {e['tid']}"))
            track.slices.append(e)
    return processes, [tracks[k] for k in sorted(tracks)]


def _phase_classes(tracks: Sequence[_Track]) -> dict[str, str]:
    """Phase -> its rects' CSS class, in the order of dialects.annotations.PHASES, then others."""
    seen = {str(s.get("args", {}).get("phase", "other")) for t in tracks for s in t.slices}
    ordered = [p for p in PHASES if p in seen] + sorted(seen - set(PHASES))
    return {p: f"k{i % len(PALETTE)}" for i, p in enumerate(ordered)}


def _locs(args: Mapping[str, Any], files: Mapping[str, int]) -> list[str]:
    """A slice's source lines as `data-locs` tokens (`0:12`), from its `location` argument."""
    places = [file_line(p) for p in str(args.get("location", "")).split(", ") if p.count(":") >= 2]
    return list(dict.fromkeys(f"{files[f]}:{n}" for f, n in places if f in files))


def _tooltip(e: Mapping[str, Any], track: str, cycles_per_us: float) -> str:
    """A slice's tooltip: the op, when and where it ran, and where it came from."""
    a = e.get("args", {})
    start = a.get("start_cycle", round(e["ts"] * cycles_per_us))
    took = round(e["dur"] * cycles_per_us)
    lines = [str(e.get("name", "")), f"{track}: cycles {start:,} to {start + took:,} ({took:,})"]
    if "phase" in a or "bound" in a:
        lines.append(f"phase {a.get('phase', '-')}, bound by {a.get('bound', '-')}, "
                     f"{a.get('bytes', 0):,} bytes, {a.get('flops', 0):,} FLOPs")
    if "location" in a:
        lines.append(f"{a['location']}: {a.get('source', '')}".rstrip(": "))
    if "created_by" in a:
        lines.append(f"made by {a['created_by']}")
    if "ir" in a:
        lines.append(str(a["ir"]))
    return "\n".join(lines)


def timeline(trace: Mapping[str, Any], critical: Mapping[int, Collection[int]] | None = None,
             files: Mapping[str, int] | None = None) -> str:
    """The timeline section: the rule it was drawn by, the phases' colours, and the SVG of the
    Chrome trace `trace` (an engine unit per row, a process's rows under its name when there
    are several), the commands of `critical` (process id -> keys) outlined, each rect's source
    lines as `data-locs` tokens of `files` (file -> its number)."""
    critical, files = critical or {}, files or {}
    events = trace.get("traceEvents", [])
    processes, tracks = _tracks(events)
    other = trace.get("otherData", {})
    clock = float(other.get("clock_hz", 1e9))
    cycles_per_us = clock / 1e6
    ends = [s["ts"] + s["dur"] for t in tracks for s in t.slices]
    span = max([other.get("total_cycles", 0) / cycles_per_us, *ends, 1e-9])
    total_cycles = round(span * cycles_per_us)
    count = sum(len(t.slices) for t in tracks)
    if not tracks:
        return '<p class="note">No command ran on an engine: nothing to draw.</p>'
    classes = _phase_classes(tracks)
    binned = count > TIMELINE_RECTS
    bins = max(1, TIMELINE_RECTS // len(tracks))
    if binned:
        rule = (f"This run has {count:,} slices, more than the {TIMELINE_RECTS:,} rects the page draws: each track is "
                f"cut into {bins:,} equal intervals of {total_cycles / bins:,.0f} cycles, and each interval with work is "
                "one rect, coloured by the phase busiest in it, as opaque as the share of the interval its engine was "
                "busy, outlined when a command on the critical path ran in it (--trace FILE writes every command).")
    else:
        rule = (f"Every slice of the trace ({count:,}) is a rect: an engine unit per row, coloured by phase, outlined "
                "when on the critical path; hover over one for its op, its passes and its source line, over a source "
                "line to light its rects.")
    several = len(processes) > 1
    rows: list[str] = []
    y = AXIS_HEIGHT
    pid = None
    for t in tracks:
        if several and t.pid != pid:
            rows.append(f'<text class="process" x="2" y="{y + ROW_HEIGHT - 3}">{_e(processes.get(t.pid, t.pid))}</text>')
            y += ROW_HEIGHT + ROW_GAP
        pid = t.pid
        rows.append(f'<text class="track" x="4" y="{y + ROW_HEIGHT - 3}">{_e(t.name)}</text>')
        on_path = set(critical.get(t.pid, ()))
        draw = _binned(t, bins, span, cycles_per_us, on_path, classes, files) if binned else \
            (_rect(s, t.name, span, cycles_per_us, on_path, classes, files) for s in t.slices)
        rows.append(f'<g transform="translate(0 {y})">' + "".join(draw) + "</g>")
        y += ROW_HEIGHT + ROW_GAP
    height = y + 4
    axis = _axis(total_cycles, span, cycles_per_us, height)
    legend = " ".join(f'<span class="key {c}">{_e(p)}</span>' for p, c in classes.items())
    svg = (f'<svg class="timeline" viewBox="0 0 {LABEL_WIDTH + PLOT_WIDTH + 40} '
           f'{height}" width="100%" role="img" aria-label="timeline">\n{axis}\n' + "\n".join(rows) + "\n</svg>")
    return (f'<p class="note">{_e(rule)}</p>\n<p class="legend">phases: {legend} '
            f'<span class="key cp">critical path</span></p>\n{svg}')


def _x(us: float, span: float) -> float:
    return LABEL_WIDTH + us / span * PLOT_WIDTH


def _axis(total_cycles: int, span: float, cycles_per_us: float, height: int) -> str:
    """Gridlines with cycle numbers, at most ten, a step of 1, 2 or 5 times a power of ten."""
    step = next(s * f for s in (10 ** k for k in range(20)) for f in (1, 2, 5) if total_cycles / (s * f) <= 10)
    ticks = []
    for c in range(0, total_cycles + 1, step):
        x = _x(c / cycles_per_us, span)
        ticks.append(f'<line class="grid" x1="{x:.1f}" y1="{AXIS_HEIGHT - 4}" x2="{x:.1f}" y2="{height}"/>'
                     f'<text class="tick" x="{x:.1f}" y="{AXIS_HEIGHT - 8}">{c:,}</text>')
    return f'<g class="axis"><text class="tick" x="2" y="{AXIS_HEIGHT - 8}">cycle</text>{"".join(ticks)}</g>'


def _rect(e: Mapping[str, Any], track: str, span: float, cycles_per_us: float, on_path: set[int],
          classes: Mapping[str, str], files: Mapping[str, int]) -> str:
    a = e.get("args", {})
    kind = classes.get(str(a.get("phase", "other")), "")
    if a.get("key") in on_path:
        kind += " cp"
    x, width = _x(e["ts"], span), max(e["dur"] / span * PLOT_WIDTH, MIN_RECT_WIDTH)
    return (f'<rect class="{kind}" x="{x:.2f}" y="0" width="{width:.2f}" height="{ROW_HEIGHT}"'
            f"{_locs_attribute(_locs(a, files))}>"
            f"<title>{_text(_tooltip(e, track, cycles_per_us))}</title></rect>")


def _locs_attribute(tokens: Collection[str]) -> str:
    return f' data-locs="{" ".join(tokens)}"' if tokens else ""


def _binned(track: _Track, bins: int, span: float, cycles_per_us: float, on_path: set[int],
            classes: Mapping[str, str], files: Mapping[str, int]) -> Iterator[str]:
    """The track in `bins` equal intervals: each interval with work one rect, coloured by the
    phase that kept its engine busiest, as opaque as the busy share of the interval."""
    width = span / bins
    busy = [0.0] * bins
    count = [0] * bins
    by_phase: list[dict[str, float]] = [{} for _ in range(bins)]
    longest: list[tuple[float, str]] = [(0.0, "")] * bins
    locs: list[dict[str, None]] = [{} for _ in range(bins)]
    crit = [False] * bins
    for e in track.slices:
        a = e.get("args", {})
        start, end = e["ts"], e["ts"] + e["dur"]
        first = int(start / width)
        last = max(first, math.ceil(end / width) - 1)  # an interval the command only touches is not its
        phase = str(a.get("phase", "other"))
        for b in range(max(first, 0), min(last, bins - 1) + 1):
            overlap = min(end, (b + 1) * width) - max(start, b * width)
            busy[b] += max(overlap, 0.0)
            by_phase[b][phase] = by_phase[b].get(phase, 0.0) + max(overlap, 0.0)
            count[b] += 1
            if e["dur"] > longest[b][0] or not longest[b][1]:
                place = f" at {a['location']}" if "location" in a else ""
                longest[b] = (e["dur"], f"{e.get('name', '')}{place}")
            locs[b].update(dict.fromkeys(_locs(a, files)))
            crit[b] = crit[b] or a.get("key") in on_path
    for b in range(bins):
        if not count[b]:
            continue
        phase = max(by_phase[b], key=lambda p: by_phase[b][p])
        share = min(busy[b] / width, 1.0)
        kind = classes.get(phase, "") + (" cp" if crit[b] else "")
        begin, end = round(b * width * cycles_per_us), round((b + 1) * width * cycles_per_us)
        title = (f"{track.name}: cycles {begin:,} to {end:,}: {count[b]:,} command(s), busy {share:.0%}, most in "
                 f"{phase}\nlongest: {longest[b][1]}")
        yield (f'<rect class="{kind}" x="{_x(b * width, span):.2f}" y="0" width="{PLOT_WIDTH / bins:.2f}" '
               f'height="{ROW_HEIGHT}" fill-opacity="{max(share, 0.15):.2f}"{_locs_attribute(locs[b])}>'
               f"<title>{_text(title)}</title></rect>")


STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0 1.5em 2em; color: #222; }
header { border-bottom: 1px solid #ccc; padding: .4em 0; }
h1 { font-size: 1.05em; margin: .2em 0; font-family: ui-monospace, monospace; font-weight: 600; }
nav a { margin-right: 1em; }
h2 { font-size: 1.1em; border-bottom: 1px solid #ddd; margin-top: 1.5em; }
.note { color: #555; max-width: 70em; }
table { border-collapse: collapse; }
.facts th { text-align: left; padding-right: 1em; vertical-align: top; white-space: nowrap; }
.facts td { font-family: ui-monospace, monospace; font-size: 12.5px; }
.source { font-size: 12.5px; }
.source th, .source td { padding: 0 .6em; text-align: right; white-space: nowrap; }
.source td.code, .source th.code { text-align: left; width: 100%; white-space: pre; }
.source tr.file th { text-align: left; background: #f3f3f3; }
.source tbody tr:hover, .source tr.hot { background: #fff4c2; }
.source tr.unlocated td.code { color: #777; }
.source tfoot td, .source tfoot th { border-top: 1px solid #999; font-weight: 600; }
.source td.share { position: relative; min-width: 5em; }
.source .bar { position: absolute; left: 0; top: 2px; bottom: 2px; background: #e15759; opacity: .35; }
code, pre { font-family: ui-monospace, monospace; }
.step { margin: .2em 0; font-family: ui-monospace, monospace; font-size: 12.5px; }
.step summary { cursor: pointer; }
.step .index { color: #888; }
.step .pass { font-weight: 600; }
.step .badge { font-size: 11px; padding: 0 .4em; border-radius: 3px; background: #59a14f; color: #fff; }
.step.unchanged { color: #888; padding-left: 1.1em; }
.step.unchanged .badge { background: #bbb; }
.step .ops { color: #555; }
pre.ir, pre.report { background: #f7f7f7; border: 1px solid #e3e3e3; padding: .5em; overflow: auto; max-height: 40em;
  font-size: 12px; }
svg.timeline { font: 10px ui-monospace, monospace; }
svg.timeline .grid { stroke: #e5e5e5; }
svg.timeline .tick { fill: #666; }
svg.timeline .process { font-weight: 600; }
svg.timeline rect.cp { stroke: #000; stroke-width: .6; }
svg.timeline rect.hot { stroke: #d00; stroke-width: 1.5; }
.key { display: inline-block; padding: 0 .5em; margin-right: .3em; color: #fff; border-radius: 3px; }
.key.cp { background: #fff; color: #000; border: 1px solid #000; }
#page-errors:empty { display: none; }
#page-errors { color: #b00; border: 1px solid #b00; padding: .5em 2em; }
""" + "".join(f".{c} {{ fill: {color}; background: {color}; }}\n" for c, color in
              ((f"k{i}", color) for i, color in enumerate(PALETTE)))

ERROR_SCRIPT = """
window.tcpcErrors = [];
window.addEventListener("error", function (event) {
  var what = event.message ? event.message + " (" + event.filename + ":" + event.lineno + ")"
    : "cannot load " + ((event.target && (event.target.src || event.target.href)) || "a resource");
  window.tcpcErrors.push(what);
  var list = document.getElementById("page-errors");
  if (list) { var item = document.createElement("li"); item.textContent = what; list.appendChild(item); }
}, true);
"""
"""First in the page: every script error, and every resource that fails to load, is listed at
the top of the page (`#page-errors`), where a reader and the browser test see it."""

PAGE_SCRIPT = """
(function () {
  var rows = document.querySelectorAll("tr[data-loc]");
  for (var i = 0; i < rows.length; i++) {
    (function (row) {
      var rects = document.querySelectorAll('rect[data-locs~="' + row.getAttribute("data-loc") + '"]');
      if (!rects.length) { return; }
      row.addEventListener("mouseenter", function () {
        for (var j = 0; j < rects.length; j++) { rects[j].classList.add("hot"); }
      });
      row.addEventListener("mouseleave", function () {
        for (var j = 0; j < rects.length; j++) { rects[j].classList.remove("hot"); }
      });
    })(rows[i]);
  }
  document.documentElement.setAttribute("data-status", window.tcpcErrors.length ? "errors" : "loaded");
})();
"""
"""Last in the page: a source line lights its rects on the timeline; then the page says it
loaded (`data-status`), or that a script failed."""
