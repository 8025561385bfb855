"""The machine in the IR (target/target_spec.py): the driver attaches the machine it compiles
for as the module's `dlti.target_system_spec`, the passes read it, and a program compiled for
a machine of less SRAM is tiled for that SRAM (issue #28)."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import pytest
from xdsl.dialects.builtin import ModuleOp
from xdsl.parser import Parser

import tcpc
from target.machine import MachineError, default_machine, load_machine
from target.target_spec import TARGET_ATTR, attach, machine_of
from tcpc.pipelines import make_context
from tcpc.program import print_ir

MIXTRAL = Path(__file__).parent.parent / "examples" / "mixtral.moe"


def numbers(machine: object) -> dict[str, object]:
    return {f.name: getattr(machine, f.name) for f in fields(machine) if f.name not in ("description", "sources", "path")}


@pytest.mark.parametrize("generic", [False, True])
def test_the_target_prints_and_parses_back_to_the_same_machine(generic: bool) -> None:
    machine = replace(load_machine("rngd-cluster"), sram_bytes_per_slice=65536, hbm_bytes_per_second=1.234567e12)
    module = ModuleOp([])
    attach(module, machine)
    text = print_ir(module, generic)
    assert '"sram.bytes_per_slice" = 65536 : i64' in text and '"name" = "rngd-cluster"' in text
    parsed = Parser(make_context(), text).parse_module()
    assert numbers(machine_of(parsed)) == numbers(machine)


def test_ir_without_a_target_compiles_for_the_default_machine() -> None:
    assert machine_of(ModuleOp([])) is default_machine()


def test_targets_are_told_apart_by_their_entries() -> None:
    """xDSL 0.74's DLTI attributes compare equal whatever their entries: the machine read from
    a target (cached) is told apart by the entries (a machine of other SRAM is another target)."""
    rngd, small = ModuleOp([]), ModuleOp([])
    attach(rngd, default_machine())
    attach(small, replace(default_machine(), sram_bytes_per_slice=16384))
    assert machine_of(small).sram_bytes_per_slice == 16384
    assert machine_of(rngd).sram_bytes_per_slice == default_machine().sram_bytes_per_slice


def test_a_target_out_of_range_is_an_error() -> None:
    module = ModuleOp([])
    attach(module, default_machine())
    text = print_ir(module).replace('"dma.engines" = 8', '"dma.engines" = 0')
    with pytest.raises(MachineError, match='"dma.engines" = 0 is out of range'):
        machine_of(Parser(make_context(), text).parse_module())


def test_the_compiler_tiles_for_the_machines_sram() -> None:
    """Two points of an SRAM sweep (16 KB and 512 KB per slice): each is compiled for its own
    machine, so their tiles differ (the smaller one's combine runs in token tiles) and neither
    needs the memory plan's spills or streams."""
    dims = dict(T=256, D=256, F=2048, E=8, K=2, B=32)
    reports = {}
    for kb in (16, 512):
        machine = replace(default_machine(), sram_bytes_per_slice=kb * 1024, name=f"rngd-{kb}k")
        program = tcpc.compile_file(MIXTRAL, dims, machine=machine)
        assert machine_of(program.module).sram_bytes_per_slice == kb * 1024
        reports[kb] = program.simulate(cost_only=True, machine=machine).report
        assert not reports[kb].spills and not reports[kb].streams
    loops = {kb: [(loop.phase, loop.tiles) for loop in r.loops] for kb, r in reports.items()}
    assert loops[16] != loops[512]
    assert ("combine", ("i32[96, 2]", "bf16[96, 2]")) in loops[16]
    assert not any(phase == "combine" for phase, _ in loops[512])


def test_a_pass_option_overrides_the_target() -> None:
    """`schedule-tokens{tile_bytes=...}` still wins over the target's SRAM."""
    dims = dict(T=256, D=256, F=2048, E=8, K=2, B=32)
    program = tcpc.compile_file(MIXTRAL, dims)
    spec = program.full_pipeline().replace("schedule-tokens", "schedule-tokens{tile_bytes=65536}")
    lowered = program.lower(spec)
    assert TARGET_ATTR in lowered.attributes
    tiled = [op for op in lowered.walk() if op.name == "scf.for" and op.attributes.get("tcpc.phase") is not None]
    assert tiled, "a 64 KB token tile budget makes token loops"


def test_the_sram_sweeps_points_are_compiled_for_their_own_machines(tmp_path: Path) -> None:
    """examples/sweeps/sram.toml's prefill points at a quarter and twice the real SRAM per slice:
    each point's program is tiled for its machine (different tiles), and neither spills or
    streams (issue #28)."""
    from tcpc.sweep import load_spec
    from tcpc.sweep.points import machine_file

    spec = load_spec(Path(__file__).parent.parent / "examples" / "sweeps" / "sram.toml")
    picked = {p["machine_overrides"]["sram.bytes_per_slice"]: p for p in spec.points
              if p["dims"]["T"] == 1024 and p["routing"] == "balanced"}
    loops = {}
    for size in (131072, 1048576):
        point = picked[size]
        machine = machine_file(point["machine"], point["machine_overrides"], tmp_path)
        program = tcpc.compile_file(point["program"], point["dims"], machine=machine)
        report = program.simulate(cost_only=True, machine=machine).report
        assert not report.spills and not report.streams
        loops[size] = [(loop.phase, loop.tiles) for loop in report.loops]
    assert loops[131072] != loops[1048576]
