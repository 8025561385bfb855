"""A mesh of chips: the single-chip machine of each chip, the mesh shape and the link model.

A mesh file (TOML) names its chip machine (`chip = "rngd"`, a built-in name or a path relative
to the file), optionally fixes the mesh shape (`[mesh] shape = [2, 4]`; without it the size
comes from `--mesh`), and describes each chip's link: `[link] bytes_per_cycle` (each direction)
and `latency_cycles` (per collective step), each with its source or assumption, as in a
machine file. `extends = "rngd_pcie"` starts from another mesh file. Mistakes raise
MachineError naming the file and the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from target.machine import (MACHINES_DIR, Machine, MachineError, _number, _read, _Field, builtin_chip_machines,
                            load_machine)

DEFAULT_MESH_MACHINE = "rngd_pcie"

LINK_SCHEMA: dict[str, _Field] = {
    "link_bytes_per_cycle": _Field("link", "bytes_per_cycle", False, 1),
    "link_latency_cycles": _Field("link", "latency_cycles", True, 0),
}


@dataclass(frozen=True)
class MeshMachine:
    name: str
    description: str
    chip: Machine
    shape: tuple[int, ...] | None
    """The mesh shape the file fixes, or None (any size)."""
    link_bytes_per_cycle: float
    link_latency_cycles: int
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    path: str = ""

    @property
    def chips(self) -> int | None:
        return math.prod(self.shape) if self.shape is not None else None

    def assumptions(self) -> dict[str, str]:
        return {k: v for k, v in self.sources.items() if v.startswith("assumption")}


def _error(path: Path, where: str, message: str) -> MachineError:
    return MachineError(f"{path}: {where}: {message}")


def load_mesh_machine(path: str | Path | None = None) -> MeshMachine:
    """Read and check a mesh file, or a built-in one by name (`rngd_pcie`, `rngd_2x4`); None
    gives rngd_pcie (RNGD chips over PCIe)."""
    path = MACHINES_DIR / f"{DEFAULT_MESH_MACHINE}.toml" if path is None else Path(path)
    if not path.exists() and path.suffix == "" and (MACHINES_DIR / f"{path}.toml").exists():
        path = MACHINES_DIR / f"{path}.toml"
    data: dict[str, Any] = _read(path)
    if "link" not in data and isinstance(data.get("chip"), dict):  # a chip machine's [chip] table
        raise _error(path, "link", "missing: this is a single-chip machine file (no chip, no [link]); a mesh "
                                   "file names one (chip = a built-in name or a path) and describes the links")
    for key in data:
        if key not in ("name", "description", "chip", "link", "mesh"):
            raise _error(path, key, "unknown section or key (a mesh file has name, description, chip, [mesh], [link])")
    chip = data.get("chip")
    if not isinstance(chip, str) or not chip:
        what = "missing" if chip is None or chip == "" else f"expected a string, got {chip!r}"
        raise _error(path, "chip", f"{what}: the single-chip machine every chip is (a name such as \"rngd\" or a path)")
    chip_path = MACHINES_DIR / f"{chip}.toml" if (MACHINES_DIR / f"{chip}.toml").exists() else path.parent / chip
    if not chip_path.exists():
        built_in = ", ".join(builtin_chip_machines())
        raise _error(path, "chip", f"'{chip}' is neither a built-in chip machine ({built_in}) "
                                   f"nor a file {chip_path}")
    if "link" in _read(chip_path):
        raise _error(path, "chip", f"'{chip}' is a mesh file ({chip_path}), not a single-chip machine "
                                   "(rngd, rngd-cluster or a chip machine file)")
    machine = load_machine(chip_path)
    link = data.get("link")
    if not isinstance(link, dict):
        raise _error(path, "link", "missing [link] table (bytes_per_cycle, latency_cycles)")
    for key in link:
        if key not in {f.key for f in LINK_SCHEMA.values()}:
            raise _error(path, f"[link] {key}", "unknown key")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, f in LINK_SCHEMA.items():
        if f.key not in link:
            raise _error(path, f"[link] {f.key}", "missing")
        values[name], sources[name] = _number(path, f, link[f.key])
    shape = None
    mesh = data.get("mesh")
    if mesh is not None:
        if not isinstance(mesh, dict) or set(mesh) != {"shape"}:
            raise _error(path, "mesh", "expected a [mesh] table with only shape = [n, ...]")
        dims = mesh["shape"]
        if (not isinstance(dims, list) or not dims
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in dims)):
            raise _error(path, "[mesh] shape", f"expected a list of positive integers, got {dims!r}")
        shape = tuple(dims)
    for key in ("name", "description"):
        if key in data and not isinstance(data[key], str):
            raise _error(path, key, "expected a string")
    return MeshMachine(data.get("name", path.stem), data.get("description", ""), machine, shape,
                       sources=sources, path=str(path), **values)
