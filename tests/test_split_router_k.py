"""split-router-k (passes/schedule/split_router_k.py): the router's matmul split along K keeps its bits,
and at decode its weight's load no longer holds one DMA engine in front of the routing."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import assert_same_bits

import tcpc
from passes.schedule.split_router_k import k_tiles
from runtime_sim.perf.cost_only import simulate_cost_only
from runtime_sim.semantics.numerics import GRID_K
from tcpc.pipelines import FULL_PIPELINE, LOWERED_PIPELINE

EXAMPLES = Path(__file__).parent.parent / "examples"
LOWERED = ",".join(LOWERED_PIPELINE)


def split_count(module) -> int:  # type: ignore[no-untyped-def]
    return sum(1 for op in module.walk() if op.name == "tile.load" and op.source.name_hint == "router")


CASES = {
    "qwen3_moe": {"T": 1, "D": 1300, "E": 8, "K": 2, "F": 32, "B": 1},  # bf16, a remainder tile
    "mixtral": {"T": 1, "D": 1100, "B": 1},  # f32 router on the widened tokens
    "gpt_oss": {"T": 2, "D": 1536, "F": 32, "E": 8, "K": 2, "B": 1},  # router bias after the matmul
    "llama4": {"T": 1, "D": 1024, "F": 32, "FS": 32, "B": 1},  # a shared expert beside it
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_split_router_gives_the_lowered_bits(name: str) -> None:
    """The IR before and after the pass (and after the full pipeline), run on the same inputs."""
    program = tcpc.compile_file(EXAMPLES / f"{name}.moe", dims=CASES[name])
    split = program.lower(f"{LOWERED},split-router-k")
    assert split_count(split) >= 2
    before = program.run(seed=5, pipeline=LOWERED).outputs
    assert_same_bits(program.run(seed=5, pipeline=f"{LOWERED},split-router-k").outputs, before)
    assert_same_bits(program.run(seed=5, pipeline=",".join(FULL_PIPELINE)).outputs, before)


@settings(max_examples=8, deadline=None)
@given(tokens=st.integers(1, 3), d=st.integers(2 * GRID_K, 3 * GRID_K + 40), engines=st.integers(1, 8),
       seed=st.integers(0, 5))
def test_any_split_of_k_at_grid_multiples_keeps_the_bits(tokens: int, d: int, engines: int, seed: int) -> None:
    """D from two grid chunks to three and a remainder, as many tiles as the engines allow."""
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe",
                                dims={"T": tokens, "D": d, "E": 32, "K": 2, "F": 16, "B": 1})
    pipeline = f"{LOWERED},split-router-k{{engines={engines}}}"
    tiles = len(k_tiles(d, engines - 1))  # one engine loads the input
    assert split_count(program.lower(pipeline)) == (tiles if tiles > 1 else 0)
    assert_same_bits(program.run(seed=seed, pipeline=pipeline).outputs, program.run(seed=seed, pipeline=LOWERED).outputs)


def test_k_tiles_are_whole_grid_chunks_at_most_one_per_engine() -> None:
    assert k_tiles(2048, 8) == [(0, 512), (512, 1024), (1024, 1536), (1536, 2048)]
    assert k_tiles(2880, 8) == [(0, 512), (512, 1024), (1024, 1536), (1536, 2048), (2048, 2560), (2560, 2880)]
    assert k_tiles(5120, 8) == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096), (4096, 5120)]
    assert k_tiles(2048, 3) == [(0, 1024), (1024, 2048)]
    assert k_tiles(4096, 7) == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)]  # Mixtral beside x
    assert k_tiles(2048, 0) == [(0, 2048)]
    for k in range(GRID_K + 1, 4000, 97):
        for engines in (1, 2, 5, 8):
            tiles = k_tiles(k, engines)
            assert tiles[0][0] == 0 and tiles[-1][1] == k and len(tiles) <= engines
            assert all(a[1] == b[0] and a[1] % GRID_K == 0 for a, b in zip(tiles, tiles[1:]))


def test_qwen3_decode_loads_its_router_on_four_engines_at_once() -> None:
    """Qwen3-30B-A3B at T = 1, real dims: the 512 KB router was one command on one engine (2,548
    cycles before its matmul could start); its four 128 KB tiles now load side by side, the
    first contraction starts when the first tile is in, and all are in well before the whole
    load would have been."""
    dims = {"T": 1, "D": 2048, "F": 768, "E": 128, "K": 8, "B": 1}
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", dims=dims)
    name = program.function().sym_name.data

    def report(passes: tuple[str, ...]):  # type: ignore[no-untyped-def]
        module = program.lower("pin-routing," + ",".join(passes))
        return simulate_cost_only(module, name, routing="balanced").report

    whole = report(tuple(p for p in FULL_PIPELINE if p != "split-router-k"))
    split = report(FULL_PIPELINE)
    loads = [o for o in split.ops if o.name == "tile.load" and o.phase == "router"]
    assert len(loads) == 4 and len({o.units for o in loads}) == 4
    whole_load = next(o for o in whole.ops if o.name == "tcp.load" and o.bytes == 2 * 2048 * 128 * 2)
    first_contraction = min(o.start for o in split.ops if o.name == "tcp.contract" and o.phase == "router")
    assert first_contraction == min(o.end for o in loads) and max(o.end for o in loads) < whole_load.end
    assert split.total_cycles < whole.total_cycles
