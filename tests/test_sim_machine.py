"""Machine files: the default RNGD numbers, their citations, and clear errors for bad files."""

from pathlib import Path

import pytest

from target.machine import MACHINES_DIR, SCHEMA, Machine, MachineError, default_machine, load_machine


def write(tmp_path: Path, text: str, name: str = "m.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_default_is_the_whole_rngd_chip() -> None:
    m = default_machine()
    assert isinstance(m, Machine) and m.name == "rngd"
    assert (MACHINES_DIR / "rngd.toml").is_file()
    assert m.clock_hz == 1e9 and m.clusters == 2 and m.slices == 256
    assert m.sram_bytes == 2 * 256 * 512 * 1024
    assert m.chip_peak_flops_per_cycle == 2 * m.peak_flops_per_cycle == 2 * 2 * 256 * 256
    assert m.chip_peak_fp8_flops_per_cycle == 2 * m.chip_peak_flops_per_cycle  # 512 TFLOPS fp8, 256 bf16
    one = load_machine("rngd-cluster")  # a built-in machine by name
    assert one.clusters == 1 and one.sram_bytes == m.sram_bytes // 2 and one.dma_engines == m.dma_engines
    assert m.macs_per_cycle_bf16 == 256 and m.tree_depth_cycles == 5
    assert (m.int_ways, m.float_ways, m.flit_bytes) == (8, 4, 32)
    assert (m.dma_engines, m.dma_bytes_per_cycle, m.dma_startup_cycles, m.dma_request_bytes) == (8, 256, 500, 256)
    assert m.hbm_bytes_per_cycle == pytest.approx(1500.0)
    assert m.peak_flops_per_cycle == 2 * 256 * 256


def test_every_number_is_cited_or_an_assumption() -> None:
    m = default_machine()
    assert set(m.sources) == set(SCHEMA)
    assert all(s.startswith(("source: ", "assumption: ")) for s in m.sources.values())
    assumed = set(m.assumptions())
    assert {"guard_cycles", "config_overhead_cycles", "filter_cycles", "ring_traversal_cycles"} <= assumed
    assert "dma_startup_cycles" not in assumed


def test_extends_overrides_single_numbers(tmp_path: Path) -> None:
    path = write(tmp_path, 'extends = "rngd"\nname = "small"\n'
                           '[chip]\nslices = { value = 4, assumption = "a test chip" }\n')
    m = load_machine(path)
    assert m.name == "small" and m.slices == 4 and m.dma_startup_cycles == 500
    assert m.sources["slices"] == "assumption: a test chip"


@pytest.mark.parametrize(
    "text, message",
    [
        ("[chip\n", "not valid TOML"),
        ('extends = "rngd"\n[chip]\nslices = { value = -3, source = "x" }\n', r"\[chip\] slices: must be positive, got -3"),
        ('extends = "rngd"\n[chip]\nslices = { value = 0, source = "x" }\n', r"\[chip\] slices: must be positive"),
        ('extends = "rngd"\n[dma]\nengines = { value = 2.5, source = "x" }\n', r"\[dma\] engines: expected an integer"),
        ('extends = "rngd"\n[dma]\nengines = { value = true, source = "x" }\n', r"\[dma\] engines: expected an integer"),
        ('extends = "rngd"\n[dma]\nengines = { value = "8", source = "x" }\n', r"\[dma\] engines: expected an integer"),
        ('extends = "rngd"\n[dma]\nturbo = { value = 2, source = "x" }\n', r"\[dma\] turbo: unknown key"),
        ('extends = "rngd"\n[cache]\nways = { value = 2, source = "x" }\n', r"cache: unknown section"),
        ('extends = "rngd"\n[dma]\nengines = 8\n', r"\[dma\] engines: expected a table"),
        ('extends = "rngd"\n[dma]\nengines = { value = 8 }\n', r"\[dma\] engines: needs exactly one of 'source' or 'assumption'"),
        ('extends = "rngd"\n[dma]\nengines = { value = 8, source = "a", assumption = "b" }\n', "needs exactly one"),
        ('extends = "nowhere.toml"\n', r"m.toml: extends: 'nowhere.toml' is neither a built-in machine \(chips: rngd, "
                                      r"rngd-cluster; meshes: rngd_2x4, rngd_pcie\) nor a file .*nowhere.toml"),
    ],
)
def test_bad_machine_files_name_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(MachineError, match=message) as info:
        load_machine(path)
    assert str(path.parent) in str(info.value)


def test_missing_key_is_named(tmp_path: Path) -> None:
    text = (MACHINES_DIR / "rngd.toml").read_text()
    lines = [line for line in text.splitlines() if not line.startswith("startup_cycles")]
    path = write(tmp_path, "\n".join(lines))
    with pytest.raises(MachineError, match=r"m\.toml: \[dma\] startup_cycles: missing"):
        load_machine(path)


def test_missing_file() -> None:
    with pytest.raises(MachineError, match="no such machine file"):
        load_machine("/nonexistent/machine.toml")
