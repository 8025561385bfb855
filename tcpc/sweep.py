"""`tcpc sweep SPEC.toml`: cost-only simulations over a grid of programs, dims, machine
variants, routing scenarios and pass options, run on Dask distributed.

A spec (examples/sweeps/*.toml) gives each parameter one value or a list of values; every
combination of the lists is one *point* (a grid), crossed with the optional `[[cases]]` (each
a partial point, e.g. one model's program and dims). A point is one cost-only compile and
simulation, the same code path as `tcpc run --cost-only` (Program.simulate). Points are
independent, so they run as Dask tasks: on a LocalCluster of this machine by default, or on
any Dask scheduler (`--scheduler ADDRESS`: SSH, Kubernetes, Slurm clusters run the same code).

Results: one row per point in `results.parquet` and `results.csv` (the inputs, cycles and
microseconds, the roofline and the ratio to it, cycles by phase on the critical path, peak
SRAM, HBM bytes, the chosen block size when the report gives one). A point that fails records
its error and the sweep goes on. Rows are keyed by a hash of the point (its parameters and the
text of the files it reads): a rerun skips the points already done, and retries the failed ones.

A mistake in the spec itself (a missing program, an unknown dim, routing scenario, machine or
pass option, more points than MAX_POINTS) is one error from load_spec, before any cluster starts.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import json
import logging
import math
import os
import tempfile
import time
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from tcpc.pipelines import FULL_PIPELINE, pipeline_spec
from tcpc.progress import Progress

if TYPE_CHECKING:
    from runtime_sim.perf.report import SimReport

Point = dict[str, Any]
"""program (absolute path), dims, machine (base), machine_overrides ("section.key" -> value),
pass_options ("pass.option" -> value), routing, seed, sram_policy."""

RESULTS = "results.parquet"
RESULTS_CSV = "results.csv"
EXTRA = "pip install 'tcpc[sweep]'"
SPEC_KEYS = {"description", "programs", "program", "routing", "machine", "seed", "sram_policy", "dims",
             "machine_overrides", "pass_options", "cases", "out"}
CASE_KEYS = {"program", "routing", "machine", "seed", "sram_policy", "dims", "machine_overrides", "pass_options"}
MAX_POINTS = 10_000
"""The most points a spec may expand to unless asked (`--max-points`, load_spec's max_points): a
few long lists crossed with each other make a grid that would run for days."""


class SweepError(Exception):
    """A spec that cannot be swept, or a missing optional dependency."""


@dataclass
class Spec:
    path: Path
    points: list[Point]
    description: str = ""
    out: Path | None = None
    """Where the results go (the spec's `out`, relative to the spec), unless --out says."""


def _values(where: str, value: Any) -> list[Any]:
    """A parameter's values: a list is an axis of the grid, anything else one value."""
    values = value if isinstance(value, list) else [value]
    if not values:
        raise SweepError(f"{where}: an empty list")
    for v in values:
        if isinstance(v, (dict, list)):
            raise SweepError(f"{where}: expected a number or a string, or a list of them")
    return values


def _machine_key(where: str, key: str) -> str:
    """A machine file key as `section.key`, given as that or as a Machine field name."""
    from target.machine import SCHEMA

    by_place = {f"{f.section}.{f.key}" for f in SCHEMA.values()}
    if key in by_place:
        return key
    if key in SCHEMA:
        return f"{SCHEMA[key].section}.{SCHEMA[key].key}"
    raise SweepError(f"{where}: '{key}' is not a machine file key (keys: {', '.join(sorted(by_place))})")


def _pass_key(where: str, key: str) -> str:
    """`PASS.OPTION`: a pass of the full pipeline and one of that pass's options."""
    from dataclasses import fields

    from tcpc.pipelines import PASSES

    name, dot, option = key.partition(".")
    if not dot or name not in FULL_PIPELINE or not option:
        raise SweepError(f"{where}: '{key}' is not PASS.OPTION of a pass of the pipeline ({', '.join(FULL_PIPELINE)})")
    options = [f.name for f in fields(PASSES[name]())]
    if option not in options:
        raise SweepError(f"{where}: '{key}': {name} has no option '{option}' "
                         f"(options: {', '.join(options) or 'none'})")
    return key


def _check_pass_option(where: str, key: str, value: Any) -> None:
    """Build the pass with this option as a point's pipeline would write it, so a value the
    pass refuses (`strategy = "best"`) is the spec's error, not every point's."""
    from tcpc.pipelines import PipelineError, parse_pipeline

    try:
        parse_pipeline(pipeline_spec(passes=(key.partition(".")[0],), topk_strategy=None, options={key: value}))
    except PipelineError as e:
        raise SweepError(f"{where}: {e}") from None


def _program_dims(where: str, path: Path) -> set[str] | None:
    """The dims a program declares (none for .mlir IR): a missing file or a syntax error is the
    spec's error, once. None when the program is too deeply nested to parse here (compile_source
    raises the limit; the points report it)."""
    from tcpc.diagnostics import CompileError
    from tcpc.parser import parse

    try:
        source = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SweepError(f"{where}: {path}: no such file") from None
    except UnicodeDecodeError as e:
        raise SweepError(f"{where}: {path}: not a UTF-8 text file (byte {e.start} is "
                         f"{e.object[e.start:e.start + 1]!r})") from None
    except OSError as e:  # a directory, no permission
        raise SweepError(f"{where}: {path}: {(e.strerror or str(e)).lower()}") from None
    if path.suffix == ".mlir":
        return set()
    try:
        return {d.name for d in parse(source).dims}
    except CompileError as e:
        raise SweepError(f"{where}: {e.render(str(path), source).splitlines()[0]}") from None
    except RecursionError:
        return None


def _check_routing(where: str, routing: str) -> None:
    """A scenario by name, or an .npz/.npy of expert choices that numpy reads (its shape is
    checked against each point's dims when the point runs)."""
    from runtime_sim.perf.routing_scenarios import SCENARIOS, RoutingError, load_choices

    if routing.endswith((".npz", ".npy")):
        try:
            load_choices(routing)
        except RoutingError as e:
            raise SweepError(f"{where}: {e}") from None
    elif routing not in SCENARIOS:
        raise SweepError(f"{where}: unknown routing scenario '{routing}' "
                         f"(expected {', '.join(SCENARIOS)}, or an .npz or .npy file)")


def _check_machine(where: str, machine: str) -> None:
    """A built-in chip machine by name, or a machine file that loads (the base of the overrides)."""
    from target.machine import MachineError, builtin_chip_machines, load_machine

    if not machine.endswith(".toml") and machine not in (builtin := builtin_chip_machines()):
        raise SweepError(f"{where}: '{machine}' is not a built-in machine ({', '.join(builtin)}) "
                         "or a .toml machine file")
    try:
        load_machine(machine)
    except MachineError as e:
        raise SweepError(f"{where}: {e}") from None


def _check_value(where: str, key: str, value: Any) -> None:
    """The spec's top-level parameters other than programs, each value on its own."""
    from runtime_sim.perf.memory_plan import SRAM_POLICIES

    if key == "routing":
        _check_routing(where, str(value))
    elif key == "machine":
        _check_machine(where, str(value))
    elif key == "sram_policy" and value not in SRAM_POLICIES:
        raise SweepError(f"{where}: '{value}' is not an SRAM policy ({', '.join(SRAM_POLICIES)})")
    elif key == "seed" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise SweepError(f"{where}: {value!r} is not a seed (a non-negative integer)")


def _axes(where: str, table: Mapping[str, Any], base: Path, allowed: set[str],
          dims_of: dict[str, set[str] | None]) -> dict[tuple[str, str], list[Any]]:
    """(group, name) -> values for one spec or case table, each value checked; `dims_of`
    collects the dims of each program (its absolute path)."""
    unknown = set(table) - allowed
    if unknown:
        raise SweepError(f"{where}: unknown key '{min(unknown)}' (keys: {', '.join(sorted(allowed))})")
    if "programs" in table and "program" in table:
        raise SweepError(f"{where}: both programs and program; give one")
    axes: dict[tuple[str, str], list[Any]] = {}
    for key in ("programs", "program"):
        if key in table:
            paths = [(base / str(p)).resolve() for p in _values(f"{where}: {key}", table[key])]
            for path in paths:
                dims_of[str(path)] = _program_dims(f"{where}: {key}", path)
            axes[("", "program")] = [str(p) for p in paths]
    for key in ("seed", "sram_policy"):
        if key in table:
            axes[("", key)] = _values(f"{where}: {key}", table[key])
    for key, suffixes in (("routing", (".npz", ".npy")), ("machine", (".toml",))):
        if key in table:  # a scenario or built-in machine by name, or a file relative to the spec
            names = _values(f"{where}: {key}", table[key])
            axes[("", key)] = [str((base / v).resolve()) if str(v).endswith(suffixes) else v for v in names]
    for (_, key), values in axes.items():
        for value in values:
            _check_value(f"{where}: {key}", key, value)
    for group, check in (("dims", None), ("machine_overrides", _machine_key), ("pass_options", _pass_key)):
        sub = table.get(group, {})
        if not isinstance(sub, dict):
            raise SweepError(f"{where}: [{group}] must be a table")
        for key, value in sub.items():
            name = check(f"{where}: [{group}]", key) if check else key
            axes[(group, name)] = _values(f"{where}: [{group}] {key}", value)
            for v in axes[(group, name)]:
                if group == "pass_options":
                    _check_pass_option(f"{where}: [{group}] {key}", name, v)
                elif group == "dims" and v != "auto" and (isinstance(v, bool) or not isinstance(v, int)):
                    raise SweepError(f"{where}: [dims] {key}: {v!r} is neither an integer nor auto")
    return axes


def _check_dims(where: str, axes: Mapping[tuple[str, str], list[Any]], dims_of: Mapping[str, set[str] | None]) -> None:
    """Every dim a case gives is declared by each of its programs (no dims for IR)."""
    given = [name for group, name in axes if group == "dims"]
    for program in axes[("", "program")]:
        declared = dims_of[program]
        if declared is None:
            continue
        for name in given:
            if name not in declared:
                known = ", ".join(sorted(declared)) if declared else "none: IR takes no dims"
                raise SweepError(f"{where}: [dims] {name}: {Path(program).name} has no dim named {name} "
                                 f"(dims: {known})")


def load_spec(path: str | Path, max_points: int | None = MAX_POINTS) -> Spec:
    """Read a sweep spec, check every value in it, and expand it into its points: at most
    `max_points` of them (None: no limit), counted before any is built."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SweepError(f"{path}: no such sweep spec") from None
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"{path}: not valid TOML: {e}") from None
    base = path.parent
    dims_of: dict[str, set[str] | None] = {}
    try:
        grid = _axes("spec", data, base, SPEC_KEYS, dims_of)
        if "out" in data and not isinstance(data["out"], str):
            raise SweepError(f"spec: out: {data['out']!r} is not a directory (a string)")
        cases = data.get("cases", [{}])
        if not isinstance(cases, list) or not all(isinstance(c, dict) for c in cases):
            raise SweepError("spec: cases must be an array of tables ([[cases]])")
        case_axes = [_axes(f"case {i + 1}", c, base, CASE_KEYS, dims_of) for i, c in enumerate(cases)]
        combined = []
        for i, case in enumerate(case_axes):
            if any(len(v) != 1 for v in case.values()):
                raise SweepError("a case gives one value per parameter (lists go in the grid)")
            axes = {**grid, **case}
            if ("", "program") not in axes:
                raise SweepError("no program (programs = [...], or program in each case)")
            _check_dims(f"case {i + 1}" if "cases" in data else "spec", axes, dims_of)
            combined.append(axes)
    except SweepError as e:
        raise SweepError(f"{path}: {e}") from None
    count = sum(math.prod(len(v) for v in axes.values()) for axes in combined)
    if max_points is not None and count > max_points:
        raise SweepError(f"{path}: {count:,} points, more than the limit of {max_points:,} "
                         "(--max-points N runs up to N)")
    points: list[Point] = []
    for axes in combined:
        names = list(axes)
        for combo in itertools.product(*(axes[n] for n in names)):
            points.append(_point(dict(zip(names, combo))))
    seen: set[str] = set()
    unique = []
    for p in points:
        if (k := point_key(p)) not in seen:
            seen.add(k)
            unique.append(p)
    out = data.get("out")
    return Spec(path, unique, str(data.get("description", "")), base / out if isinstance(out, str) else None)


def _point(values: Mapping[tuple[str, str], Any]) -> Point:
    point: Point = {"program": "", "dims": {}, "machine": "rngd", "machine_overrides": {}, "pass_options": {},
                    "routing": "balanced", "seed": 0, "sram_policy": "spill"}
    for (group, name), value in values.items():
        if group:
            point[group][name] = value
        else:
            point[name] = value
    return point


def point_key(point: Point) -> str:
    """A hash of the point's parameters and of the files it reads (its program, and a machine
    or routing file): an edited file reruns the points that read it."""
    h = hashlib.sha256(json.dumps(point, sort_keys=True).encode())
    for name in ("program", "machine", "routing"):
        path = Path(str(point[name]))
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def input_columns(point: Point) -> dict[str, Any]:
    """The point's parameters as flat columns: program (file name), routing, seed, sram_policy,
    machine, dim.NAME, machine.SECTION.KEY, pass.PASS.OPTION."""
    routing = str(point["routing"])
    cols: dict[str, Any] = {"program": Path(point["program"]).name,
                            "routing": Path(routing).name if routing.endswith((".npz", ".npy")) else routing,
                            "seed": point["seed"], "sram_policy": point["sram_policy"],
                            "machine": Path(point["machine"]).stem}
    cols.update({f"dim.{k}": v for k, v in point["dims"].items()})
    cols.update({f"machine.{k}": v for k, v in point["machine_overrides"].items()})
    cols.update({f"pass.{k}": str(v) for k, v in point["pass_options"].items()})
    return cols


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
            pipeline = pipeline_spec(options=point["pass_options"])
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


def _arrow() -> Any:
    try:
        import pyarrow
        import pyarrow.csv
        import pyarrow.parquet
    except ImportError:
        raise SweepError(f"tcpc sweep writes Parquet with pyarrow: {EXTRA}") from None
    return pyarrow


GROUPS = ("dim.", "machine.", "pass.", "phase.")
"""The prefixes of the columns after the core ones, in the order they are written."""


def _column_order(name: str) -> tuple[int, str]:
    prefix = name.split(".")[0] + "."
    return (GROUPS.index(prefix) if prefix in GROUPS else len(GROUPS), name)


def to_table(rows: Sequence[Mapping[str, Any]]) -> Any:
    pa = _arrow()
    core = dict(CORE_SCHEMA)
    extra = sorted({k for r in rows for k in r} - set(core), key=_column_order)
    fields = [pa.field(name, getattr(pa, t)()) for name, t in CORE_SCHEMA]
    columns = [pa.array([r.get(name) for r in rows], type=f.type) for name, f in zip(core, fields)]
    for name in extra:
        values = [r.get(name) for r in rows]
        given = [v for v in values if v is not None and not isinstance(v, bool)]
        if name.startswith("phase.") or all(isinstance(v, int) for v in given):
            column = pa.array(values, type=pa.int64())
        elif all(isinstance(v, (int, float)) for v in given):
            column = pa.array([None if v is None else float(v) for v in values], type=pa.float64())
        else:
            column = pa.array([None if v is None else str(v) for v in values], type=pa.string())
        fields.append(pa.field(name, column.type))
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def write_results(rows: Sequence[Mapping[str, Any]], out: Path) -> None:
    """results.parquet and results.csv, each written whole and then moved into place."""
    pa = _arrow()
    out.mkdir(parents=True, exist_ok=True)
    table = to_table(rows)
    for name, write in ((RESULTS, pa.parquet.write_table), (RESULTS_CSV, pa.csv.write_csv)):
        tmp = out / f".{name}.tmp"
        write(table, str(tmp))
        os.replace(tmp, out / name)


def read_results(out: Path) -> list[dict[str, Any]]:
    """The rows of an earlier run (none when there is no results file)."""
    path = out / RESULTS
    if not path.exists():
        return []
    pa = _arrow()
    try:
        return pa.parquet.read_table(str(path)).to_pylist()
    except Exception as e:  # pyarrow's errors have no common base
        raise SweepError(f"{path}: cannot read the earlier results ({e}); move it away to start over") from None


# ---------------------------------------------------------------- running


class SweepProgress(Progress):
    """`sweep: done / total points (failed)` on a terminal (the op-level Progress, counting points)."""

    def __init__(self, total: int, stream: IO[str] | None = None, *, force: bool = False):
        super().__init__(total, stream, delay=0.0, force=force)
        self.failed = 0
        if self.enabled:  # at once: starting a cluster takes seconds
            self._draw(f"sweep: 0 / {total:,} points")

    def point_done(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        now = time.monotonic()
        if not self.enabled or (now - self.last < self.interval and self.done < (self.total or 0)):
            return
        self.last = now
        failed = f", {self.failed} failed" if self.failed else ""
        self._draw(f"sweep: {self.done:,} / {self.total:,} points{failed}")


@dataclass
class SweepOutcome:
    out: Path
    rows: list[dict[str, Any]]
    """Every row of the results file: this spec's points and any earlier ones."""
    ran: int
    skipped: int
    failed: list[dict[str, Any]] = field(default_factory=list)
    """The rows of this run's points that failed."""
    succeeded: int = 0
    """How many of the spec's points have a row with status ok (from this run or an earlier one)."""


def check_out(out: Path, named: str) -> None:
    """Make `out` the results directory, or refuse it (an existing file, a directory that
    cannot be made or written) before any point runs, so a sweep never ends unable to save.
    `named` says where the path came from (`-o DIR`)."""
    if out.exists() and not out.is_dir():
        raise SweepError(f"{named}: is a file; the results go in a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file on the way, no permission
        raise SweepError(f"{named}: cannot make the results directory: {(e.strerror or str(e)).lower()}") from None
    if not os.access(out, os.W_OK):
        raise SweepError(f"{named}: permission denied")


def _client(scheduler: str | None, workers: int | None, processes: bool) -> tuple[Any, Any]:
    try:
        from dask.distributed import Client, LocalCluster
    except ImportError:
        raise SweepError(f"tcpc sweep runs on Dask distributed: {EXTRA}") from None
    if scheduler is not None:
        try:
            return Client(scheduler, timeout="10s"), None
        except (OSError, TimeoutError, ValueError) as e:  # ValueError: not an address
            message = f"--scheduler {scheduler}: cannot connect ({e})"
        # The half-built Client is garbage now: collect it here, so its __del__ (which stops its
        # event loop) does not run at a random later allocation, such as inside the next
        # LocalCluster's loop start, where distributed's LoopRunner lock deadlocks against it.
        gc.collect()
        raise SweepError(message)
    cluster = LocalCluster(n_workers=workers or os.cpu_count() or 1, threads_per_worker=1, processes=processes,
                           dashboard_address=":0", silence_logs=logging.ERROR)
    return Client(cluster), cluster


def run_sweep(spec: Spec, out: Path, *, scheduler: str | None = None, workers: int | None = None,
              processes: bool = True, progress: IO[str] | None = None, save_every: float = 10.0) -> SweepOutcome:
    """Run the spec's points not already done in `out`, on a LocalCluster (`workers` worker
    processes, or threads with processes=False) or on the Dask scheduler at `scheduler`."""
    check_out(out, str(out))
    earlier = {r["key"]: r for r in read_results(out)}
    todo = [p for p in spec.points if earlier.get(point_key(p), {}).get("status") != "ok"]
    rows = dict(earlier)
    outcome = SweepOutcome(out, [], len(todo), len(spec.points) - len(todo))
    if todo:
        client, cluster = _client(scheduler, workers, processes)
        from dask.distributed import as_completed

        bar = SweepProgress(len(todo), progress)
        saved = time.monotonic()
        try:
            futures = client.map(run_point, todo, pure=False)
            points = {f.key: p for f, p in zip(futures, todo)}
            for future in as_completed(futures):
                try:
                    row = future.result()
                except Exception as e:  # a worker that died: the point's row says so
                    point = points[future.key]
                    row = {"key": point_key(point), **input_columns(point), "status": "error",
                           "error": f"the worker failed: {error_text(e, point)}"}
                rows[row["key"]] = row
                if row["status"] != "ok":
                    outcome.failed.append(row)
                bar.point_done(row["status"] == "ok")
                if time.monotonic() - saved > save_every:
                    write_results(list(rows.values()), out)
                    saved = time.monotonic()
        finally:
            bar.close()
            write_results(list(rows.values()), out)  # whatever finished, even when interrupted
            client.close()
            if cluster is not None:
                cluster.close()
    elif not (out / RESULTS).exists():
        write_results([], out)
    order = [point_key(p) for p in spec.points]
    outcome.rows = [rows[k] for k in order if k in rows] + [r for k, r in rows.items() if k not in set(order)]
    outcome.succeeded = sum(rows[k]["status"] == "ok" for k in order if k in rows)
    if todo:
        write_results(outcome.rows, out)
    return outcome


# ---------------------------------------------------------------- charts

INPUT_PREFIXES = ("dim.", "machine.", "pass.")
INPUT_COLUMNS = ("program", "routing", "seed", "sram_policy", "machine")


def swept_parameters(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """The input columns that take more than one value among `rows`."""
    rows = list(rows)
    names = list(INPUT_COLUMNS) + sorted({k for r in rows for k in r if k.startswith(INPUT_PREFIXES)})
    return [n for n in names if len({json.dumps(r.get(n)) for r in rows}) > 1]


def _label(row: Mapping[str, Any], names: Sequence[str]) -> str:
    """`T=64, sram.bytes_per_slice=128 KB`: the dim. and machine. prefixes left out."""
    return ", ".join(f"{n.removeprefix('dim.').removeprefix('machine.')}={_tick(n, row.get(n))}" for n in names) or "all"


def plot(rows: Sequence[Mapping[str, Any]], out: Path) -> list[Path]:
    """roofline.png (arithmetic intensity vs achieved FLOP/s under each machine's roof) and
    cycles_vs_PARAM.png for each swept parameter; the points that succeeded only."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SweepError(f"tcpc sweep --plot draws with matplotlib: {EXTRA}") from None
    ok = [r for r in rows if r.get("status") == "ok" and r.get("total_cycles")]
    if not ok:
        raise SweepError("nothing to plot: no point succeeded")
    swept = swept_parameters(ok)
    paths = [_roofline_chart(plt, ok, swept, out / "roofline.png")]
    for name in swept:
        paths.append(_cycles_chart(plt, ok, name, [s for s in swept if s != name],
                                   out / f"cycles_vs_{name.replace('.', '_')}.png"))
    return paths


def _roofline_chart(plt: Any, rows: Sequence[Mapping[str, Any]], swept: Sequence[str], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7.5, 5))
    points = [r for r in rows if r.get("arithmetic_intensity") and r.get("achieved_flops_per_s")]
    xs = [r["arithmetic_intensity"] for r in points]
    lo, hi = (min(xs) / 4, max(xs) * 4) if xs else (0.1, 1e4)
    roofs = sorted({(r["peak_flops_per_s"], r["hbm_bytes_per_s"]) for r in rows})
    for peak, bandwidth in roofs:
        knee = peak / bandwidth
        grid = sorted({lo, hi, min(max(knee, lo), hi)})
        label = f"roof: {peak / 1e12:.0f} TFLOP/s, {bandwidth / 1e12:.2f} TB/s" if len(roofs) > 1 else \
            f"roof: {peak / 1e12:.0f} TFLOP/s peak, {bandwidth / 1e12:.2f} TB/s HBM"
        ax.plot(grid, [min(peak, x * bandwidth) for x in grid], "k-" if len(roofs) == 1 else "-", lw=1.5, label=label)
    colour_by = swept[0] if swept else None
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in points:
        groups.setdefault(_label(r, [colour_by]) if colour_by else "points", []).append(r)
    for name, group in groups.items():
        ax.scatter([r["arithmetic_intensity"] for r in group], [r["achieved_flops_per_s"] for r in group],
                   s=28, label=name, zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per HBM byte)")
    ax.set_ylabel("achieved FLOP/s (layer FLOPs / simulated time)")
    ax.set_title("Roofline: simulated MoE layers")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _sort_key(value: Any) -> tuple[int, Any]:
    return (0, value) if isinstance(value, (int, float)) else (1, str(value))


def _tick(name: str, value: Any) -> str:
    if "bytes" in name and isinstance(value, int):
        for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
            if value >= scale and value % scale == 0:
                return f"{value // scale} {unit}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _cycles_chart(plt: Any, rows: Sequence[Mapping[str, Any]], name: str, others: Sequence[str], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(10 if others else 7.5, 5))
    values = sorted({r.get(name) for r in rows}, key=_sort_key)
    numeric = all(isinstance(v, (int, float)) for v in values)
    position = {v: (v if numeric else i) for i, v in enumerate(values)}
    lines: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        lines.setdefault(_label(r, others), []).append(r)
    for label, group in list(lines.items())[:12]:
        group = sorted(group, key=lambda r: _sort_key(r.get(name)))
        ax.plot([position[r.get(name)] for r in group], [r["total_cycles"] for r in group], "o-", ms=4, label=label)
    if len(lines) > 12:
        ax.set_title(f"{len(lines) - 12} more combinations not drawn", fontsize=8, loc="right")
    if numeric and len(values) > 2 and min(values) > 0 and max(values) / min(values) >= 4:
        ax.set_xscale("log", base=2)
    if not numeric or len(values) <= 10:
        ticks = [position[v] for v in values]
        ax.set_xticks(ticks, [_tick(name, v) for v in values])
        ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel(name)
    ax.set_ylabel("total cycles")
    ax.set_title(f"Cycles against {name}", loc="left")
    ax.grid(True, which="both", alpha=0.3)
    if len(lines) > 1:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
