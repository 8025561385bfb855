"""Sweep specs: loading and checking a spec whole (before any cluster starts), its grid of
points, and each point's key and input columns."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tcpc.pipelines import FULL_PIPELINE, pipeline_spec



Point = dict[str, Any]
"""program (absolute path), dims, machine (base), machine_overrides ("section.key" -> value),
pass_options ("pass.option" -> value), routing, seed, sram_policy."""

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

    by_place = {f.dotted for f in SCHEMA.values()}
    if key in by_place:
        return key
    if key in SCHEMA:
        return SCHEMA[key].dotted
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
