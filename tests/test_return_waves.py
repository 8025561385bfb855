"""a2a's split pairs returned in waves (shard-experts{waves}, passes/schedule/return_waves.py):
each wave issued once the receiver's blocks of its experts are computed keeps the bits, and
pays where a skewed routing's hot chip returns many rows."""

from pathlib import Path

import numpy as np
import pytest
from xdsl.dialects import func, scf

import tcpc
from dialects import ccl, moe
from dialects.annotations import phase_of
from runtime_sim.perf.mesh_simulate import simulate_mesh
from runtime_sim.semantics.ccl_semantics import a2a_plan, a2a_returns
from runtime_sim.semantics.moe_semantics import route_plan
from runtime_sim.semantics.tolerance import compare_outputs
from target.mesh_machine import load_mesh_machine
from support import assert_same_bits, mesh_outputs
from tcpc.mesh_run import MeshSpec
from tcpc.program import Program

EXAMPLES = Path(__file__).parent.parent / "examples"


def _without(pipeline: str) -> str:
    return ",".join(p for p in pipeline.split(",") if p != "return-waves")


def _expert_loops(module: object) -> int:
    body = next(op for op in module.walk() if isinstance(op, func.FuncOp)).body.block  # type: ignore[attr-defined]
    return sum(1 for op in body.ops if isinstance(op, scf.ForOp) and phase_of(op) == "experts")


def test_waves_issued_inside_the_expert_loop_keep_the_bits() -> None:
    """Qwen3-MoE's small layer with K = 8 of 16 experts on 2 chips at 4 tokens a chip, in 8 waves
    under the loop (one of each of a chip's first 7 experts, whose blocks end by block 9 e of
    64, B = 1) and one of the last expert after it: a chip receives about 32 pairs. Every chip
    runs the IR before and after return-waves on the same inputs, the same outputs bit for bit,
    which are one chip's; after it the expert loop is in 8 pieces, a wave after each. (Cuts at a
    quarter of the blocks shard-experts allows made the outputs differ.)"""
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", dims={"T": 8, "K": 8, "B": 1})
    spec = MeshSpec.parse("ep=2,waves=8")
    after = spec.pipeline()
    assert (_expert_loops(program.lower(_without(after))), _expert_loops(program.lower(after))) == (1, 8)
    before, moved = mesh_outputs(program, spec, [_without(after), after], 3)
    assert_same_bits(moved, before)
    results = compare_outputs(moved, program.run(seed=3).outputs)
    assert all(c.identical for c in results), [c.message for c in results]


def _cycles(program: Program, spec: MeshSpec, pipeline: str) -> tuple[int, int]:
    """The slowest chip's cycles, cost-only under skewed routing, and the first wave's start on chip 0."""
    module = program.lower(pipeline)
    result = simulate_mesh(module, program.function(None).sym_name.data, load_mesh_machine(), cost_only=True,
                           routing="skewed", seed=1)
    start = next(x.start for x in result.report.links if x.chip == 0 and x.label.startswith("%returned0 ="))
    return result.report.total_cycles, start


def test_waves_pay_under_skewed_routing() -> None:
    """Qwen3-MoE with D = 2,048 on 2 chips at 32 tokens a chip, skewed routing (seed 1): chip 0
    receives most pairs, and its split pairs went back after its expert loop (in one all-to-all:
    129,085 cycles). In waves=4 (4 waves that may leave under the loop, one of the last experts
    after it), without return-waves every wave follows the loop; with it the first start under it."""
    dims = {"T": 64, "D": 2048, "F": 512, "E": 32, "K": 8, "B": 16}
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", dims=dims)
    spec = MeshSpec.parse("ep=2,waves=4")
    after = spec.pipeline(cost_only=True)
    (late, late_start), (waved, start) = _cycles(program, spec, _without(after)), _cycles(program, spec, after)
    # (132,005, 117,425) before the plans' cumsums were chunked; (131,849, 117,339) before the pinned routing
    # was read after the router's top-k (`tcp.order`)
    assert (late, waved) == (131_877, 117_320)
    assert start < late_start


@pytest.mark.parametrize("ends", [(2, 4), (1, 3, 4)])
def test_a2a_returns_waves_split_the_split_pairs(ends: tuple[int, ...]) -> None:
    """ccl.a2a_returns' waves (ranges of a chip's 4 local experts ending at `ends`) over random
    routings of 4 tokens, K = 3 of 8 experts on 2 chips: each split pair is in exactly one wave,
    the one of its local expert's range, listed at the head of its destination's slice; the
    token tables are the unwaved op's."""
    rng = np.random.default_rng(0)
    chips, experts, k = 2, 8, 3
    for _ in range(50):
        top_e = np.stack([rng.choice(experts, k, replace=False) for _ in range(4)]).astype(np.int32)
        slots = 4 * k
        slot_rows = a2a_plan(top_e, chips, experts, slots)[0]
        whole = a2a_returns(slot_rows, chips, slots, k, 0, True)
        ranges = list(zip((0, *ends), ends))
        parts = [a2a_returns(slot_rows, chips, slots, k, 0, True, (top_e, experts, a, b)) for a, b in ranges]
        local = experts // chips
        covered = np.full(top_e.shape, -1)
        for w, (pair_slots, pair_counts, token_returns, pair_returns, sum_counts) in enumerate(parts):
            assert np.array_equal(token_returns, whole[2]) and np.array_equal(sum_counts, whole[4])
            listed = pair_returns >= 0
            assert ((ranges[w][0] <= top_e[listed] % local) & (top_e[listed] % local < ranges[w][1])).all()
            assert (covered[listed] == -1).all()
            covered[listed] = w
            for d in range(chips):
                assert (pair_slots[d, :pair_counts[d]] > 0).all() and (pair_slots[d, pair_counts[d]:] == 0).all()
        assert np.array_equal(covered >= 0, whole[3] >= 0)
        assert sum(p[1] for p in parts).tolist() == whole[1].tolist()


@pytest.mark.parametrize("spec, message", [
    ("ep=2,strategy=a2a_sum,waves=2", "a2a returns its split pairs in waves, without tp, sp or chunks"),
    ("ep=2,chunks=2,waves=2", "a2a returns its split pairs in waves, without tp, sp or chunks"),
    ("ep=2,waves=9", "each wave takes some of a chip's 4 experts' pairs"),
])
def test_waves_that_cannot_be_are_refused(spec: str, message: str) -> None:
    program = tcpc.compile_file(EXAMPLES / "mixtral.moe")
    with pytest.raises(Exception, match=message):
        program.lower(MeshSpec.parse(spec).pipeline(lowered=False))


def test_a_wave_count_that_is_not_a_positive_integer_is_refused() -> None:
    with pytest.raises(ccl.MeshSpecError, match="waves = '0' is not a positive integer"):
        MeshSpec.parse("ep=2,waves=0")


def test_a_wave_ends_at_the_blocks_its_experts_can_fill() -> None:
    """Qwen3-MoE's small layer (K = 8 of 16 experts) on 2 chips at 4 tokens a chip, B = 8: a chip
    receives 8 tokens, so an expert has at most 8 pairs, one block, and the first e experts' pairs
    sit in its first e blocks (moe.max_blocks over e experts), where a bound of N / B + e blocks
    (2 e) left every wave past the first 3 experts after the loop: waves end at blocks 2, 4, 6, 7
    and 8 of 8. No routing of the received tokens puts a wave's pairs past its blocks."""
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", dims={"T": 8, "K": 8, "B": 8})
    module = program.lower(MeshSpec.parse("ep=2,waves=4").pipeline(lowered=False))
    starts = [op for op in module.walk()
              if isinstance(op, ccl.AllToAllStartOp) and ccl.WAVE_BLOCKS_ATTR in op.attributes]
    waves = [op.attributes[ccl.WAVE_BLOCKS_ATTR].value.data for op in starts]  # type: ignore[attr-defined]
    assert waves == [2, 4, 6, 7, 8]
    route = moe.RouteType.make(8, 8, 8, 8, 8)
    rng = np.random.default_rng(0)
    for _ in range(200):
        lists = np.stack([np.where(rng.random(8) < 0.7, rng.permutation(8), -1) for _ in range(8)])
        ids = route_plan(lists, route).expert_ids
        for end, blocks in zip((2, 4, 6, 7, 8), waves):
            assert not ((ids[blocks:] >= 0) & (ids[blocks:] < end)).any()
