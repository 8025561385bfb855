"""The Chrome trace (`--trace`) against the report: every unit of every engine, and every chip
of a mesh, has its own named track, and the trace's events are the report's commands, unit by
unit, at the times the report gives, as Perfetto reads them; each says where its op came from
(source location and line, the passes that made it, its IR), and flows join each DMA command
to the tensor-unit commands that wait for it."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from target.machine import default_machine
from runtime_sim.perf.report import EngineRecord, OpRecord, SimReport, roofline
from tcpc.cli import main

RNGD_TRACKS = {"tensor unit 0", "tensor unit 1", *(f"dma {u}" for u in range(8))}
"""The tracks of one RNGD chip: a tensor unit per cluster and the eight DMA engines."""


def perfetto_ns(microseconds: float) -> int:
    """A ts or dur as Perfetto's JSON importer reads it: microseconds rounded to the nanosecond."""
    return round(microseconds * 1000)


def check_process(events: list[dict[str, Any]], pid: int, process: str, report: dict[str, Any],
                  tracks: set[str]) -> dict[int, dict[str, Any]]:
    """Process `pid` of the trace is the run of `report` (its --report-json dict): named
    `process`, one track named in `tracks` per unit of every engine with units, and per command
    and unit it occupies one complete event on that unit's track, with the command's label, its
    part's start and its cycles, none overlapping another on its track. Returns key -> the
    arguments of the command's event (of its first part)."""
    mine = [e for e in events if e["pid"] == pid]
    meta = {(e["name"], e["tid"]): e["args"] for e in mine if e["ph"] == "M"}
    assert meta[("process_name", 0)] == {"name": process}
    names = {tid: a["name"] for (kind, tid), a in meta.items() if kind == "thread_name"}
    assert sorted(names.values()) == sorted(tracks)  # one track per name
    assert {tid for kind, tid in meta if kind == "thread_sort_index"} == set(names)
    units = {e["name"]: e["units"] for e in report["engines"] if e["units"]}
    ops = {o["key"]: o for o in report["ops"]}
    to_ns = 1e9 / report["clock_hz"]
    per_unit: Counter[tuple[str, int]] = Counter()
    parts: Counter[tuple[int, int]] = Counter()
    spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
    args: dict[int, dict[str, Any]] = {}
    moved: Counter[tuple[int, str]] = Counter()
    for e in mine:
        if e["ph"] in ("M", "s", "f"):  # flows: check_flows
            continue
        assert e["ph"] == "X"
        op = ops[e["args"]["key"]]
        name = names[e["tid"]]
        unit = 0 if units[op["engine"]] == 1 else int(name.rsplit(" ", 1)[1])
        assert e["cat"] == op["engine"] and name.startswith(op["engine"]) and unit in op["units"]
        i = op["units"].index(unit)
        n = len(op["units"])
        assert e["name"] == (op["label"] if n == 1 else f"{op['label']} ({i + 1}/{n})")
        start = op["part_starts"][i] if op["part_starts"] else op["start"]
        begin, end = round(start * to_ns), round((start + op["cycles"]) * to_ns)
        assert (perfetto_ns(e["ts"]), perfetto_ns(e["dur"])) == (begin, end - begin)
        assert e["args"]["start_cycle"] == start and e["args"]["cycles"] == op["cycles"]
        per_unit[(op["engine"], unit)] += 1
        parts[(op["key"], unit)] += 1
        spans[e["tid"]].append((begin, end))
        args.setdefault(op["key"], e["args"])
        for figure in ("bytes", "hbm_bytes", "flops"):
            moved[(op["key"], figure)] += e["args"][figure]
    # A command's parts carry shares of its bytes and FLOPs: summed, the report's, never counted twice.
    assert moved == {(o["key"], f): o[f] for o in report["ops"] if units.get(o["engine"])
                     for f in ("bytes", "hbm_bytes", "flops")}
    # Counted engine by engine and unit by unit, the events are the report's commands.
    expected = Counter((o["engine"], u) for o in report["ops"] if units.get(o["engine"]) for u in o["units"])
    assert per_unit == expected
    assert set(parts) == {(o["key"], u) for o in report["ops"] if units.get(o["engine"]) for u in o["units"]}
    assert set(parts.values()) == {1}
    for track in spans.values():  # Perfetto drops a complete event that overlaps another
        track.sort()
        assert all(a[1] <= b[0] for a, b in zip(track, track[1:]))
    assert max(end for track in spans.values() for _, end in track) == round(report["total_cycles"] * to_ns)
    return args


def check_flows(events: list[dict[str, Any]], pid: int, report: dict[str, Any]) -> int:
    """Process `pid`'s flows are one per DMA command and tensor-unit command that waits for it
    (a dependency in the report), from the DMA command's first event to the other's, as
    Perfetto binds them (the finish to its enclosing slice). Returns how many."""
    mine = [e for e in events if e["pid"] == pid]
    ops = {o["key"]: o for o in report["ops"]}
    first = {}
    for e in mine:
        if e["ph"] == "X":
            first.setdefault(e["args"]["key"], (e["tid"], e["ts"]))
    starts = {e["id"]: e for e in mine if e["ph"] == "s"}
    finishes = {e["id"]: e for e in mine if e["ph"] == "f"}
    assert set(starts) == set(finishes) and len(starts) == sum(1 for e in mine if e["ph"] == "s")
    joined = set()
    for flow, s in starts.items():
        f = finishes[flow]
        assert f["bp"] == "e" and s["name"] == f["name"] == "waits for"
        dma = next(k for k, place in first.items() if place == (s["tid"], s["ts"]) and ops[k]["engine"] == "dma")
        waiting = next(k for k, place in first.items() if place == (f["tid"], f["ts"]) and dma in ops[k]["deps"])
        assert ops[waiting]["engine"] == "tensor"
        joined.add((dma, waiting))
    expected = {(d, o["key"]) for o in report["ops"] if o["engine"] == "tensor" for d in o["deps"]
                if ops[d]["engine"] == "dma"}
    assert joined == expected
    return len(joined)


def test_a_slice_says_where_its_op_came_from_and_what_it_waited_for(tmp_path: Path) -> None:
    """Mixtral's trace: every command's event names its op's `.moe` location and line as written,
    the passes that made it, and its IR as `tcpc compile --emit scheduled` names its values;
    every contraction of the expert loop waits for a weight load, and the trace draws it."""
    trace, report = tmp_path / "t.json", tmp_path / "r.json"
    assert main(["run", "examples/mixtral.moe", "--trace", str(trace), "--report-json", str(report)]) == 0
    data, events = json.loads(report.read_text()), json.loads(trace.read_text())["traceEvents"]
    source = Path("examples/mixtral.moe").read_text().splitlines()
    args = check_process(events, 1, f"tcpc on {data['machine']}", data, RNGD_TRACKS)
    ops = {o["key"]: o for o in data["ops"]}
    for key, a in args.items():
        op = ops[key]
        assert op["locations"] and a["location"] == ", ".join(op["locations"])
        lines = dict.fromkeys(int(p.split(":")[1]) for p in op["locations"])
        assert a["source"] == " | ".join(source[n - 1].strip() for n in lines)
        assert a["created_by"] == ", ".join(op["created_by"]) and op["created_by"]
        assert op["name"] in a["ir"] and all(name in a["ir"] for name in op["label"].split(" = ")[0].split(", ")
                                             if name.startswith("%"))
    contractions = [k for k, o in ops.items() if o["name"] == "tcp.contract" and "lower-dispatch" in o["created_by"]]
    assert contractions and all(any(ops[d]["name"] == "tile.load_expert" for d in ops[k]["deps"]) for k in contractions)
    assert check_flows(events, 1, data) >= len(contractions)


@pytest.mark.parametrize("example", ["mixtral", "llama4"])
def test_the_trace_has_every_op_of_the_report_unit_by_unit(example: str, tmp_path: Path) -> None:
    """The issue's run: mixtral's report has commands on both tensor units, and so has its trace."""
    trace, report = tmp_path / "t.json", tmp_path / "r.json"
    assert main(["run", f"examples/{example}.moe", "--trace", str(trace), "--report-json", str(report)]) == 0
    data, written = json.loads(report.read_text()), json.loads(trace.read_text())
    assert written["displayTimeUnit"] == "ns" and written["otherData"]["clock_hz"] == data["clock_hz"]
    assert {o["unit"] for o in data["ops"] if o["engine"] == "tensor"} == {0, 1}
    check_process(written["traceEvents"], 1, f"tcpc on {data['machine']}", data, RNGD_TRACKS)
    check_flows(written["traceEvents"], 1, data)


def test_a_mesh_trace_has_every_op_of_every_chip(tmp_path: Path) -> None:
    """Chip c is process c + 1, `chip c`, with its engines' tracks and its link's; a
    collective's event carries its link figures."""
    trace, report = tmp_path / "t.json", tmp_path / "r.json"
    assert main(["run", "examples/mixtral.moe", "--mesh", "ep=2", "--trace", str(trace),
                 "--report-json", str(report)]) == 0
    data, events = json.loads(report.read_text()), json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {1, 2}
    for c, chip in enumerate(data["chips"]):
        args = check_process(events, c + 1, f"chip {c}", chip, RNGD_TRACKS | {"link"})
        check_flows(events, c + 1, chip)
        links = [x for x in data["links"] if x["chip"] == c]
        assert links
        for x in links:
            assert {k: args[x["key"]][k] for k in ("busy_cycles", "wait_cycles", "sent_bytes", "received_bytes")} \
                == {k: x[k] for k in ("busy_cycles", "wait_cycles", "sent_bytes", "received_bytes")}


def test_each_part_of_a_command_on_several_units_shows_when_its_unit_ran_it() -> None:
    """`big` runs on DMA engines 0 and 1: its part on engine 1 began at 0 (engine 1 was free),
    on engine 0 at 100 when `a` ended; `c` then ran on engine 1 from 50. Drawn at `big`'s start
    on both tracks, its part would overlap `c`, and Perfetto would drop one of them. Each part
carries its share of `big`'s bytes, not all of them."""
    machine = default_machine()

    def record(key: int, label: str, unit: int, start: int, cycles: int, units: tuple[int, ...] = (),
               part_starts: tuple[int, ...] = (), nbytes: int = 0) -> OpRecord:
        return OpRecord(key, label, "tcp.load", "dma", unit, start, start + cycles, cycles, nbytes, nbytes, 0, "dma",
                        units=units or (unit,), part_starts=part_starts)

    ops = [record(0, "%a = tcp.load", 0, 0, 100),
           record(1, "%big = tcp.load", 0, 100, 50, (0, 1), (100, 0), nbytes=1001), record(2, "%c = tcp.load", 1, 50, 80)]
    engines = [EngineRecord("tensor", 2, 0, 0.0), EngineRecord("dma", 8, 280, 0.0), EngineRecord("none", None, 0, 0.0)]
    report = SimReport(machine, 150, roofline(machine, 0, 0), ops, engines, [0, 1], 0, machine.sram_bytes, "spill")
    trace = json.loads(json.dumps(report.chrome_trace()))
    check_process(trace["traceEvents"], 1, f"tcpc on {machine.name}", report.to_json(), RNGD_TRACKS)
    big = {e["name"]: e["ts"] for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["key"] == 1}
    assert big == {"%big = tcp.load (1/2)": 0.1, "%big = tcp.load (2/2)": 0.0}
    shares = {e["name"]: e["args"]["hbm_bytes"] for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["key"] == 1}
    assert shares == {"%big = tcp.load (1/2)": 501, "%big = tcp.load (2/2)": 500}  # not 1,001 each
