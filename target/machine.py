"""The machine model: the numbers the cost model uses, read from a TOML machine file.

Every number in a machine file carries where it comes from (`source = "..."`) or why it was
assumed (`assumption = "..."`), so a report can always say what a cycle count rests on. The
default machine is `machines/rngd.toml` (the whole RNGD chip, 2 clusters of 256 slices). A file may start
from another with `extends = "rngd"` (a built-in name, or a path relative to the file) and
override single numbers. Mistakes (bad TOML, a missing or unknown key, a wrong type, a number
that must be positive, a number too large to simulate, a file that is not UTF-8 text) raise
MachineError naming the file and the key. A file that extends another is named by its own
`name`, or by its file name: never by the machine it extends.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

MACHINES_DIR = Path(__file__).parent / "machines"
DEFAULT_MACHINE = "rngd"


class MachineError(Exception):
    """A machine file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class _Field:
    """One number of the schema: where it lives in the file and what values are allowed."""

    section: str
    key: str
    integer: bool
    minimum: int  # 1: must be positive; 0: may be zero (latencies that an ideal machine drops)
    maximum: float = 2**40
    """Larger numbers cannot be simulated: cycle counts are summed over thousands of commands
    and must stay exact integers in 64-bit floats (below 2^53)."""

    @property
    def dotted(self) -> str:
        """`section.key`: how a sweep overrides the number and the IR's target spec names it."""
        return f"{self.section}.{self.key}"


SCHEMA: dict[str, _Field] = {
    "clock_hz": _Field("chip", "clock_hz", False, 1, 1e15),
    "clusters": _Field("chip", "clusters", True, 1),
    "slices": _Field("chip", "slices", True, 1),
    "sram_bytes_per_slice": _Field("sram", "bytes_per_slice", True, 1),
    "fetch_bytes_per_cycle": _Field("sram", "fetch_bytes_per_cycle", True, 1),
    "commit_bytes_per_cycle": _Field("sram", "commit_bytes_per_cycle", True, 1),
    "macs_per_cycle_bf16": _Field("contraction", "macs_per_cycle_bf16", True, 1),
    "lanes": _Field("contraction", "lanes", True, 1),
    "packet_bytes": _Field("contraction", "packet_bytes", True, 1),
    "accumulator_cells": _Field("contraction", "accumulator_cells", True, 1),
    "tree_depth_cycles": _Field("contraction", "tree_depth_cycles", True, 0),
    "macs_per_cycle_fp8": _Field("contraction", "macs_per_cycle_fp8", True, 1),
    "tree_depth_fp8_cycles": _Field("contraction", "tree_depth_fp8_cycles", True, 0),
    "trf_banks": _Field("trf", "banks", True, 1),
    "trf_rows_per_bank": _Field("trf", "rows_per_bank", True, 1),
    "trf_row_bytes": _Field("trf", "row_bytes", True, 1),
    "flit_bytes": _Field("vector", "flit_bytes", True, 1),
    "int_ways": _Field("vector", "int_ways", True, 1),
    "float_ways": _Field("vector", "float_ways", True, 1),
    "alu_latency_cycles": _Field("vector", "alu_latency_cycles", True, 0),
    "filter_cycles": _Field("vector", "filter_cycles", True, 0),
    "ring_traversal_cycles": _Field("vector", "ring_traversal_cycles", True, 0),
    "dma_engines": _Field("dma", "engines", True, 1),
    "dma_bytes_per_cycle": _Field("dma", "bytes_per_cycle", True, 1),
    "dma_startup_cycles": _Field("dma", "startup_cycles", True, 0),
    "dma_request_bytes": _Field("dma", "request_bytes", True, 1),
    "dma_split_bytes": _Field("dma", "split_bytes", True, 1),
    "hbm_bytes_per_second": _Field("hbm", "bytes_per_second", False, 1, 1e18),
    "guard_cycles": _Field("control", "guard_cycles", True, 0),
    "config_overhead_cycles": _Field("control", "config_overhead_cycles", True, 0),
}
"""Machine field -> its place in the file. Sections and keys outside this table are errors."""

_TOP_LEVEL = {"name", "description", "extends"}


@dataclass(frozen=True)
class Machine:
    """The chip as the cost model sees it: `clusters` clusters of `slices` slices each. Rates
    are per slice unless named otherwise; a cluster runs in lockstep, so one command occupies
    one cluster's contraction and vector engines (the tensor engine has a unit per cluster)."""

    name: str
    description: str
    clock_hz: float
    clusters: int
    slices: int
    sram_bytes_per_slice: int
    fetch_bytes_per_cycle: int
    commit_bytes_per_cycle: int
    macs_per_cycle_bf16: int
    lanes: int
    packet_bytes: int
    accumulator_cells: int
    tree_depth_cycles: int
    macs_per_cycle_fp8: int
    tree_depth_fp8_cycles: int
    trf_banks: int
    trf_rows_per_bank: int
    trf_row_bytes: int
    flit_bytes: int
    int_ways: int
    float_ways: int
    alu_latency_cycles: int
    filter_cycles: int
    ring_traversal_cycles: int
    dma_engines: int
    dma_bytes_per_cycle: int
    dma_startup_cycles: int
    dma_request_bytes: int
    dma_split_bytes: int
    hbm_bytes_per_second: float
    guard_cycles: int
    config_overhead_cycles: int
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Field -> "source: ..." or "assumption: ..."."""
    path: str = field(default="", compare=False)

    @property
    def sram_bytes(self) -> int:
        """SRAM of the whole chip, every cluster's (the memory plan keeps each cluster's
        buffers in its own `cluster_sram_bytes`; the schedule level copies what a cluster reads
        from another by DMA)."""
        return self.clusters * self.slices * self.sram_bytes_per_slice

    @property
    def cluster_sram_bytes(self) -> int:
        """One cluster's SRAM: what one cluster's share of a schedule (an expert's weight tiles,
        a token tile) is sized for, and what the buffers its engines read must fit in (each
        slice fetches from and commits to its own DM: furiosa-opt book, Fetch Engine, Commit
        Engine)."""
        return self.slices * self.sram_bytes_per_slice

    @property
    def hbm_bytes_per_cycle(self) -> float:
        return self.hbm_bytes_per_second / self.clock_hz

    @property
    def peak_macs_per_cycle(self) -> int:
        """bf16 MACs per cycle of one cluster: a contraction command's peak."""
        return self.macs_per_cycle_bf16 * self.slices

    @property
    def peak_fp8_macs_per_cycle(self) -> int:
        """fp8 x fp8 MACs per cycle of the cluster (f4e2m1 weights run at this rate too: the
        fetch stage's lookup table makes them f8e4m3)."""
        return self.macs_per_cycle_fp8 * self.slices

    @property
    def peak_flops_per_cycle(self) -> int:
        """Two FLOPs per MAC: one cluster's contraction peak, what a single command can reach."""
        return 2 * self.peak_macs_per_cycle

    @property
    def chip_peak_flops_per_cycle(self) -> int:
        """Every cluster's peak together: the FLOP side of the roofline."""
        return self.clusters * self.peak_flops_per_cycle

    @property
    def chip_peak_fp8_flops_per_cycle(self) -> int:
        """Every cluster's fp8 peak together: the FLOP side of a block-scaled contraction's
        roofline (fp8 and f4e2m1 weights)."""
        return self.clusters * 2 * self.peak_fp8_macs_per_cycle

    @property
    def trf_bytes(self) -> int:
        """The TRF's payload per slice (book, Register Files: 8 lanes x 2 banks x 128 rows, each
        320-bit row holding 16 bf16 or 32 f8, 32 bytes): what a stationary operand may fill."""
        return self.lanes * self.trf_banks * self.trf_rows_per_bank * self.trf_row_bytes

    def cycles_to_us(self, cycles: float) -> float:
        return cycles / self.clock_hz * 1e6

    def assumptions(self) -> dict[str, str]:
        """The numbers that no public figure backs, with the reason given for each."""
        return {k: v for k, v in self.sources.items() if v.startswith("assumption")}


def _error(path: Path, where: str, message: str) -> MachineError:
    return MachineError(f"{path}: {where}: {message}")


def _read(path: Path, depth: int = 0) -> dict[str, Any]:
    """The file's TOML with its `extends` chain merged in (later files override numbers)."""
    if depth > 8:
        raise MachineError(f"{path}: 'extends' chain is too deep (a cycle?)")
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise MachineError(f"{path}: no such machine file") from None
    except OSError as e:
        raise MachineError(f"{path}: cannot read the machine file: {(e.strerror or str(e)).lower()}") from None
    except UnicodeDecodeError as e:
        raise MachineError(f"{path}: not a UTF-8 text file (byte {e.start} is {e.object[e.start:e.start + 1]!r})") from None
    except tomllib.TOMLDecodeError as e:
        raise MachineError(f"{path}: not valid TOML: {e}") from None
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise _error(path, "extends", "expected a machine name or a path (a string)")
    base_path = MACHINES_DIR / f"{base}.toml" if (MACHINES_DIR / f"{base}.toml").exists() else path.parent / base
    if not base_path.is_file():
        chips = builtin_chip_machines()
        meshes = sorted(p.stem for p in MACHINES_DIR.glob("*.toml") if p.stem not in chips)
        raise _error(path, "extends", f"'{base}' is neither a built-in machine (chips: {', '.join(chips)}; "
                                      f"meshes: {', '.join(meshes)}) nor a file {base_path}")
    merged = _read(base_path, depth + 1)
    merged.pop("name", None)  # a machine is named by its own file, never by the one it extends
    merged["description"] = f"{base} with the numbers of {path.name}"
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _number(path: Path, f: _Field, entry: Any) -> tuple[int | float, str]:
    where = f"[{f.section}] {f.key}"
    if not isinstance(entry, dict):
        raise _error(path, where, "expected a table { value = ..., source = \"...\" } or { value = ..., assumption = \"...\" }")
    unknown = set(entry) - {"value", "source", "assumption"}
    if unknown:
        raise _error(path, where, f"unknown key(s) {', '.join(sorted(unknown))} (allowed: value, source, assumption)")
    if "value" not in entry:
        raise _error(path, where, "missing 'value'")
    cites = [k for k in ("source", "assumption") if k in entry]
    if len(cites) != 1 or not isinstance(entry[cites[0]], str) or not entry[cites[0]].strip():
        raise _error(path, where, "needs exactly one of 'source' or 'assumption' (a non-empty string)")
    value = entry["value"]
    kinds = (int,) if f.integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise _error(path, where, f"expected {'an integer' if f.integer else 'a number'}, got {value!r}")
    if not value >= f.minimum:  # also rejects NaN
        need = ("positive" if not value > 0 else "at least 1") if f.minimum else "zero or more"
        raise _error(path, where, f"must be {need}, got {value!r}")
    if value > f.maximum:  # also rejects inf
        raise _error(path, where, f"{value!r} is too large to simulate (at most {f.maximum:.4g})")
    return value, f"{cites[0]}: {entry[cites[0]].strip()}"


def load_machine(path: str | Path | None = None) -> Machine:
    """Read and check a machine file, or a built-in machine by name (`rngd`, `rngd-cluster`);
    None gives the default RNGD machine."""
    path = MACHINES_DIR / f"{DEFAULT_MACHINE}.toml" if path is None else Path(path)
    if not path.exists() and path.suffix == "" and (MACHINES_DIR / f"{path}.toml").exists():
        path = MACHINES_DIR / f"{path}.toml"
    data = _read(path)
    sections = {f.section for f in SCHEMA.values()}
    for key, value in data.items():
        if key in _TOP_LEVEL:
            if not isinstance(value, str):
                raise _error(path, key, "expected a string")
        elif key not in sections:
            raise _error(path, key, f"unknown section or key (sections: {', '.join(sorted(sections))})")
        elif not isinstance(value, dict):
            raise _error(path, key, "expected a [section] table")
    known = {(f.section, f.key) for f in SCHEMA.values()}
    for section in sections & set(data):
        for key in data[section]:
            if (section, key) not in known:
                raise _error(path, f"[{section}] {key}", "unknown key")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, f in SCHEMA.items():
        entry = data.get(f.section, {}).get(f.key)
        if entry is None:
            raise _error(path, f"[{f.section}] {f.key}", "missing")
        values[name], sources[name] = _number(path, f, entry)
    return Machine(name=data.get("name", path.stem), description=data.get("description", ""),
                   sources=sources, path=str(path), **values)


@cache
def default_machine() -> Machine:
    return load_machine(None)


def builtin_chip_machines() -> list[str]:
    """The names of the built-in single-chip machines (the machines directory also holds mesh
    files, which have a [link] table)."""
    return sorted(p.stem for p in MACHINES_DIR.glob("*.toml") if "link" not in _read(p))
