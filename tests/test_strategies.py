"""benchmarks/strategies.py on toy dims: every strategy runs and stays above its roofline, and
padded dispatch is the blockwise pipeline with B = T (one T-row block per expert). No
wall-clock assertions."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_script

import tcpc
from dialects import moe
from dialects.tensor_types import shape_of

strategies = load_script("strategies")
TOY = dict(T=8, D=16, F=32, E=4, K=2, B=4)


@pytest.mark.parametrize("strategy", strategies.STRATEGIES)
def test_every_strategy_runs_above_its_roofline(strategy: str) -> None:
    model = strategies.MODELS[0]
    row = strategies.strategy_row(model, TOY["T"], strategy, dims=TOY)
    assert row.total_cycles >= row.roofline_cycles > 0
    assert row.hbm_bytes > 0 and row.peak_sram_bytes > 0
    assert row.block == (None if strategy == "dense" else TOY["T"] if strategy == "padded" else TOY["B"])
    assert strategy in strategies.table([row])


def test_padded_is_blockwise_with_one_t_row_block_per_expert() -> None:
    """The padded row is the blockwise pipeline's at B = T, whose blocked buffer is the
    padded-scatter plan's [E, T, D] (T*K >= E here, so G = E blocks of T rows)."""
    model, t = strategies.MODELS[0], TOY["T"]
    padded = strategies.strategy_row(model, t, "padded", dims=TOY)
    blockwise = strategies.strategy_row(model, t, "blockwise", dims={**TOY, "B": t})
    assert (padded.total_cycles, padded.hbm_bytes, padded.peak_sram_bytes) == (
        blockwise.total_cycles, blockwise.hbm_bytes, blockwise.peak_sram_bytes)
    program = tcpc.compile_source(model.path.read_text(), dims={**TOY, "B": t}, filename=str(model.path))
    scatter = next(op for op in program.module.walk() if isinstance(op, moe.ScatterOp))
    assert shape_of(scatter.blocked.type) == (TOY["E"], t, TOY["D"])


def test_dense_reads_every_experts_weights() -> None:
    model = strategies.MODELS[0]
    dense = strategies.strategy_row(model, TOY["T"], "dense", dims={**TOY, "T": 1})
    blockwise = strategies.strategy_row(model, 1, "blockwise", dims={**TOY, "T": 1, "B": 1})
    # T = 1, K = 2 of E = 4: dense loads all four experts' weights, blockwise gathers two.
    assert dense.hbm_bytes > blockwise.hbm_bytes
