"""benchmarks/precisions.py: its format variants compile and simulate to the reference, its
chip limit follows the bytes, and a row at small dims is consistent."""

from __future__ import annotations

import re

import numpy as np
import pytest

import tcpc
from target.machine import load_machine
from tests.benchmark_scripts import load_script

precisions = load_script("precisions")

SMALL = {"DeepSeek-V3": dict(D=256, F=128, FS=128, E=16, K=4, NG=4, TG=2),
         "Qwen3-30B-A3B": dict(D=256, F=128, E=16, K=4),
         "gpt-oss-120b": dict(D=128, F=128, E=16, K=4)}


@pytest.mark.parametrize("family", precisions.FAMILIES, ids=lambda f: f.title)
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_variants_declare_the_format_and_run_exactly(family, fmt: str) -> None:  # type: ignore[no-untyped-def]
    stem, blocks = family.sources[fmt]
    source = precisions.variant((precisions.EXAMPLES / f"{stem}.moe").read_text(), fmt)
    weights = re.findall(r"\b(w\w*): (\w+)\[", source)
    assert weights and all(t == precisions.STORED[fmt] for name, t in weights if not name.endswith("_scale"))
    assert all(t == precisions.SCALE[fmt] for name, t in weights if name.endswith("_scale"))
    small = {**SMALL[family.title], **{k: min(v, 32) for k, v in blocks.items()}, "T": 8, "B": 2}
    program = tcpc.compile_source(source, dims=small)
    want, got = program.run(seed=1).outputs[0], program.simulate(seed=1).outputs[0]
    assert np.array_equal(want.view(np.uint16), got.view(np.uint16))


def test_chip_limit_follows_the_stored_width() -> None:
    machine = load_machine()
    qwen = precisions.FAMILIES[1]
    limits = {fmt: precisions.chip_limit(machine, qwen, fmt, 1, qwen.sources[fmt][1]) for fmt in precisions.FORMATS}
    # decode is bound by bytes: fp8 about half of bf16, MXFP4 about a quarter (plus scales, router, tokens)
    assert 0.45 < limits["fp8"] / limits["bf16"] < 0.55
    assert 0.25 < limits["mxfp4"] / limits["bf16"] < 0.32
    prefill = {fmt: precisions.chip_limit(machine, qwen, fmt, 4096, qwen.sources[fmt][1]) for fmt in ("bf16", "fp8")}
    assert prefill["fp8"] < prefill["bf16"]


def test_the_scales_floor_runs_the_partial_sums_at_the_vector_engines_rate() -> None:
    """A block-scaled contraction scales one f32 partial sum per K-block of each result in the
    vector engine, `float_ways` a cycle per slice against 512 fp8 MACs: MXFP4's K-blocks of 32
    take 4x the experts' MAC time, gpt-oss's fp8 blocks of 64 2x, blocks of 128 keep up (the
    floor is the limit), and decode stays bound by bytes."""
    machine = load_machine()
    _, qwen, gpt = precisions.FAMILIES

    def cycles(family: precisions.Family, fmt: str, tokens: int, scales: bool) -> float:
        return precisions.chip_limit(machine, family, fmt, tokens, family.sources[fmt][1], scales=scales)

    def macs_and_router(family: precisions.Family, tokens: int) -> tuple[float, float]:
        d = family.dims
        macs = tokens * d["K"] * 3 * d["D"] * d["F"] / (machine.peak_fp8_macs_per_cycle * machine.clusters)
        return macs, 2 * tokens * d["D"] * d["E"] / (machine.peak_flops_per_cycle * machine.clusters)

    for fmt in precisions.FORMATS:
        assert cycles(qwen, fmt, 1, True) == cycles(qwen, fmt, 1, False)
    assert cycles(qwen, "bf16", 4096, True) == cycles(qwen, "bf16", 4096, False)
    assert cycles(qwen, "fp8", 4096, True) == cycles(qwen, "fp8", 4096, False)
    macs, router = macs_and_router(qwen, 4096)
    assert cycles(qwen, "mxfp4", 4096, False) == pytest.approx(macs + router)
    assert cycles(qwen, "mxfp4", 4096, True) == pytest.approx(4 * macs + router)
    macs, router = macs_and_router(gpt, 4096)
    assert cycles(gpt, "fp8", 4096, True) == pytest.approx(2 * macs + router)
    assert cycles(gpt, "mxfp4", 4096, True) == pytest.approx(4 * macs + router)


def test_the_seed_formats_floor_decodes_every_weight_once_on_the_vector_engine() -> None:
    """fp4_groups and trellis3 decode each weight with f32 multiplies (scale, signs) in one pass
    of the vector engine's chain, `float_ways` a cycle per slice, on the tensor unit that also
    contracts, whose contraction then fetches each decoded bf16 weight at 32 B a cycle per
    slice: at one token those two, not HBM, are the floor (Qwen3-30B-A3B: 8 experts' 37.7 M
    weights over 2 x 256 slices, 18.4k cycles decoding 4 a cycle, 4.6k fetching 16 a cycle,
    above the 13.3k of the weights' bytes); at prefill the MACs outlast the fetch."""
    machine = load_machine()
    qwen = precisions.FAMILIES[1]
    chip = machine.slices * machine.clusters
    weights = 8 * 3 * 2048 * 768
    decode, fetch = weights / (machine.float_ways * chip), weights * 2 / (machine.fetch_bytes_per_cycle * chip)
    router = 2 * 2048 * 128 / (machine.peak_flops_per_cycle * machine.clusters)
    for fmt in precisions.SEED_FORMATS:
        floor = precisions.chip_limit(machine, qwen, fmt, 1, qwen.sources[fmt][1], scales=True)
        assert floor == pytest.approx(decode + fetch + router)
        assert floor > precisions.chip_limit(machine, qwen, fmt, 1, qwen.sources[fmt][1])
    every = 128 * 3 * 2048 * 768
    macs = 2 * 2048 * 8 * 3 * 2048 * 768 / (machine.peak_flops_per_cycle * machine.clusters)
    router = 2 * 2048 * 2048 * 128 / (machine.peak_flops_per_cycle * machine.clusters)
    prefill = precisions.chip_limit(machine, qwen, "fp4_groups", 2048, qwen.sources["fp4_groups"][1], scales=True)
    assert prefill == pytest.approx(macs + every / (machine.float_ways * chip) + router)


def test_row_at_small_dims_is_consistent(monkeypatch: pytest.MonkeyPatch) -> None:
    machine = load_machine()
    family = precisions.Family("small Qwen3", SMALL["Qwen3-30B-A3B"], 0, 2,
                               {"bf16": ("qwen3_moe", {}), "fp8": ("qwen3_moe_fp8", dict(QK=128, QN=128, QG=128)),
                                "mxfp4": ("qwen3_moe_fp8", precisions.MX_BLOCKS)})
    monkeypatch.setattr(precisions, "FAMILIES", (family,))
    rows = precisions.rows_for((4,), machine)
    assert [r.fmt for r in rows] == list(precisions.FORMATS)
    assert rows[0].ratio == 1.0
    for r in rows:
        assert r.total_cycles >= r.experts_cycles > 0
        assert r.hbm_bytes > 0
        assert r.floor_cycles >= r.limit_cycles and r.total_cycles >= r.floor_cycles
        assert 0 < r.first_load < r.last_load <= r.total_cycles and 0 < r.load_bytes < r.hbm_bytes
    assert rows[1].hbm_bytes < rows[0].hbm_bytes and rows[2].hbm_bytes < rows[1].hbm_bytes
    assert {r.strategy for r in rows} <= {"rank", "rounds"}  # chosen by the cost model (strategy=auto)
    assert all(isinstance(r.block, int) and r.block >= 1 for r in rows)  # chosen by the compiler (block=auto)
    text = precisions.table(rows, machine)
    assert text.count("\n") == 2 + len(rows) - 1 and "small Qwen3" in text


def test_the_benchmark_leaves_the_top_k_strategy_to_the_cost_model() -> None:
    assert precisions.pipeline_with_auto_topk("lower-topk,lower-routing") == "pin-routing,lower-topk{strategy=auto},lower-routing"
    named = "lower-topk{strategy=rounds},lower-routing"
    assert precisions.pipeline_with_auto_topk(named) == "pin-routing," + named


def test_seed_formats_have_rows_of_their_own(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """fp4_groups and trellis3 (with bf16, their ratio's reference) at small dims, bytes at the
    stored width (3 bits < 4 bits < bf16), and their section of precisions.md replaced by a
    rerun, the rest of the file kept."""
    machine = load_machine()
    qwen = precisions.FAMILIES[1]
    limits = {fmt: precisions.chip_limit(machine, qwen, fmt, 1, qwen.sources[fmt][1]) for fmt in ("bf16", *precisions.SEED_FORMATS)}
    assert limits["trellis3"] < limits["fp4_groups"] < 0.3 * limits["bf16"]
    family = precisions.Family("small Qwen3", SMALL["Qwen3-30B-A3B"], 0, 2,
                               {"bf16": ("qwen3_moe", {}), "fp4_groups": ("qwen3_moe_fp4_groups", dict(GS=32)),
                                "trellis3": ("qwen3_moe_trellis3", dict(GS=32))})
    monkeypatch.setattr(precisions, "FAMILIES", (family,))
    rows = precisions.rows_for((4,), machine, formats=precisions.SEED_FORMATS)
    assert [r.fmt for r in rows] == ["bf16", *precisions.SEED_FORMATS]
    assert rows[2].hbm_bytes < rows[1].hbm_bytes < rows[0].hbm_bytes
    path = tmp_path / "precisions.md"
    path.write_text("# Precisions (`full run`)\n\n| the main table |\n")
    precisions.write_section(path, "## fp4_groups, trellis3 (`run a`, machine rngd)", "| first |")
    precisions.write_section(path, "## fp4_groups, trellis3 (`run b`, machine rngd)", "| second |")
    text = path.read_text()
    assert "| the main table |" in text and "| second |" in text and "| first |" not in text and text.count("\n## ") == 1
