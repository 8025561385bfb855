"""benchmarks/strategies.py on toy dims: every strategy runs and stays above its roofline, and
padded dispatch is the blockwise pipeline with B = T (one T-row block per expert). No
wall-clock assertions."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_script

from dialects.moe import max_blocks

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


def test_padded_is_one_t_row_block_per_expert() -> None:
    for t, k, e in ((8, 2, 4), (64, 8, 128), (2048, 2, 8), (16, 8, 128)):
        assert max_blocks(t, k, e, block=t) == e  # T*K >= E: G = E blocks of T rows
    assert max_blocks(1, 2, 8, block=1) == 2  # T*K < E: only the experts a token can pick


def test_dense_reads_every_experts_weights() -> None:
    model = strategies.MODELS[0]
    dense = strategies.strategy_row(model, TOY["T"], "dense", dims={**TOY, "T": 1})
    blockwise = strategies.strategy_row(model, 1, "blockwise", dims={**TOY, "T": 1, "B": 1})
    # T = 1, K = 2 of E = 4: dense loads all four experts' weights, blockwise gathers two.
    assert dense.hbm_bytes > blockwise.hbm_bytes
