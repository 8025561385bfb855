"""One sweep point: a cost-only compile and simulation on its own machine (a Dask task), and
the row it gives."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tcpc.pipelines import pipeline_spec
from tcpc.sweep.spec import Point, input_columns, point_key

if TYPE_CHECKING:
    from runtime_sim.perf.report import SimReport


def machine_file(base: str, overrides: Mapping[str, Any], directory: Path) -> Path | str:
    """A machine file that `extends` the base machine with the overrides (each marked as a
    sweep's assumption, as machine files require), or the base itself without any."""
    from target.machine import MACHINES_DIR

    if not overrides:
        return MACHINES_DIR / f"{base}.toml" if (MACHINES_DIR / f"{base}.toml").exists() else base
    lines = [f"extends = {json.dumps(base)}", f"name = {json.dumps(Path(base).stem + ' (swept)')}"]
    by_section: dict[str, list[str]] = {}
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        by_section.setdefault(section, []).append(
            f"{name} = {{ value = {json.dumps(value)}, assumption = \"a sweep's what-if value\" }}")
    for section, entries in by_section.items():
        lines += [f"[{section}]", *entries]
    path = directory / "machine.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def chosen_block(report: SimReport) -> int | None:
    """The block size the compiler chose by the cost model (the first `block=auto` scatter's,
    or one whose block did not fit), or None when the program fixed it."""
    for choice in report.choices:
        if choice.what == "block":
            return int(choice.chosen)
    return None


def report_columns(report: SimReport) -> dict[str, Any]:
    m, r = report.machine, report.roofline
    seconds = report.total_cycles / m.clock_hz
    cols: dict[str, Any] = {
        "total_cycles": report.total_cycles,
        "microseconds": report.microseconds,
        "roofline_cycles": r.cycles,
        "roofline_ratio": report.total_cycles / r.cycles if r.cycles > 0 else None,
        "roofline_bound": r.bound,
        "flops": r.flops,
        "hbm_bytes": r.hbm_bytes,
        "hbm_bytes_moved": sum(o.hbm_bytes for o in report.ops),  # the memory plan's spills and streams too
        "arithmetic_intensity": r.flops / r.hbm_bytes if r.hbm_bytes else None,
        "achieved_flops_per_s": r.flops / seconds if seconds > 0 else None,
        "peak_flops_per_s": m.chip_peak_flops_per_cycle * m.clock_hz,
        "hbm_bytes_per_s": m.hbm_bytes_per_second,
        "peak_sram_bytes": report.peak_sram_bytes,
        "sram_capacity_bytes": report.sram_capacity,
        "spills": len(report.spills),
        "streams": len(report.streams),
        "block_size": chosen_block(report),
    }
    cols.update({f"phase.{p.name}": p.critical_cycles for p in report.phases})
    return cols


def error_text(e: BaseException, point: Point) -> str:
    """One line, as `tcpc run` would say it."""
    from tcpc.diagnostics import CompileError

    if isinstance(e, CompileError):
        return e.render(Path(point["program"]).name, "").splitlines()[0]
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def run_point(point: Point) -> dict[str, Any]:
    """One point: compile, lower and simulate cost-only (a Dask task; never raises)."""
    from passes.lowering.lower_dispatch import quantizes_dispatched_tokens
    from tcpc.program import compile_file

    start = time.perf_counter()
    row: dict[str, Any] = {"key": point_key(point), **input_columns(point)}
    try:
        with tempfile.TemporaryDirectory(prefix="tcpc-sweep-") as tmp:
            machine = machine_file(point["machine"], point["machine_overrides"], Path(tmp))
            # a block=auto (or one that does not fit) is chosen for this point's machine and routing
            program = compile_file(point["program"], point["dims"], machine=machine, routing=point["routing"],
                                   seed=point["seed"])
            # `tcpc run --cost-only`'s pipeline (strategy=auto resolved by Program.simulate) unless
            # the point's pass options name other values
            quantize = "auto" if quantizes_dispatched_tokens(program.module) else None
            pipeline = pipeline_spec(options=point["pass_options"], expert_order="auto", dispatch_quantize=quantize)
            sim = program.simulate(cost_only=True, pipeline=pipeline, machine=machine,
                                   routing=point["routing"], seed=point["seed"], sram_policy=point["sram_policy"])
        row.update(status="ok", error="", dims=",".join(f"{k}={v}" for k, v in program.dims.items()),
                   **report_columns(sim.report))
    except Exception as e:  # the sweep goes on; the row says why
        row.update(status="error", error=error_text(e, point))
    row["seconds"] = time.perf_counter() - start
    return row


# ---------------------------------------------------------------- results


CORE_SCHEMA: tuple[tuple[str, str], ...] = (
    ("key", "string"), ("status", "string"), ("error", "string"), ("program", "string"), ("routing", "string"),
    ("seed", "int64"), ("sram_policy", "string"), ("machine", "string"), ("dims", "string"),
    ("total_cycles", "int64"), ("microseconds", "float64"), ("roofline_cycles", "float64"),
    ("roofline_ratio", "float64"), ("roofline_bound", "string"), ("flops", "int64"), ("hbm_bytes", "int64"),
    ("hbm_bytes_moved", "int64"), ("arithmetic_intensity", "float64"), ("achieved_flops_per_s", "float64"),
    ("peak_flops_per_s", "float64"), ("hbm_bytes_per_s", "float64"), ("peak_sram_bytes", "int64"),
    ("sram_capacity_bytes", "int64"), ("spills", "int64"), ("streams", "int64"), ("block_size", "int64"),
    ("seconds", "float64"),
)
"""Columns every results file has, with their Arrow types; then dim.*, machine.*, pass.* (the
swept inputs) and phase.* (critical-path cycles by phase), typed from their values."""
