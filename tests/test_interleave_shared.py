"""interleave-shared (passes/schedule/interleave_shared.py): a shared expert's work spread
through the routed expert loop keeps the bits, goes where the docstring says, and is done only
where the routed loop waits for HBM."""

from pathlib import Path

import pytest
from xdsl.dialects import func, scf

import tcpc
from tcpc.program import Program
from dialects import tcp, tile
from dialects.annotations import cluster_of, phase_of
from passes.schedule._f_tiles import CONTRACTIONS
from passes.schedule.interleave_shared import interleaves, spreads
from passes.schedule.split_clusters import contraction_flops_per_weight_byte
from target.machine import default_machine
from tcpc.pipelines import LOWERED_PIPELINE
from runtime_sim.semantics.tolerance import compare_outputs
from tcpc.mesh_run import MeshSpec, simulate_on_mesh
from tests.test_schedule import F_TILE_MODES, assert_same_bits
from tests.support import mesh_outputs

EXAMPLES = Path(__file__).parent.parent / "examples"
SPLIT = ",".join(LOWERED_PIPELINE) + f",schedule-shared,schedule-experts{F_TILE_MODES['streamed']},split-clusters"


def _top_level(program: Program, pipeline: str) -> list[str]:
    """The function body's loops and shared contractions, in program order: `shared` for a
    shared contraction (bf16/f32 or block-scaled), `routed a-b` for a piece of the routed loop over blocks [a, b),
    `shared loop` for a shared loop left whole."""
    module = program.lower(pipeline)
    body = next(op for op in module.walk() if op.name == "func.func").body.block
    found: list[str] = []
    for op in body.ops:
        if isinstance(op, scf.ForOp) and phase_of(op) == "experts":
            found.append(f"routed {op.lb.owner.value.value.data}-{op.ub.owner.value.value.data}")
        elif isinstance(op, scf.ForOp) and phase_of(op) == "shared":
            found.append("shared loop")
        elif isinstance(op, CONTRACTIONS) and phase_of(op) == "shared":
            found.append("shared")
    return found


SPREAD_CASES = {
    "llama4": ({"T": 256, "D": 16, "FS": 1100, "B": 4}, 9, 64),
    "deepseek_v3": ({"T": 256, "D": 16, "FS": 1100, "B": 4}, 9, 256),
    "deepseek_v3_fp8": ({"T": 256, "D": 128, "F": 128, "FS": 256, "E": 8, "K": 2, "NG": 4, "TG": 2, "B": 8}, 3, 64),
}
"""Example -> its dims, the shared contractions of a row block, the blocks every routing fills."""


@pytest.mark.parametrize("example", sorted(SPREAD_CASES))
def test_the_shared_contractions_go_between_pieces_of_the_routed_loop_and_keep_the_bits(example: str) -> None:
    """T = 256: 2 row blocks, one per cluster. bf16: FS = 1100 in streamed F tiles of 512, 512
    and 76 (3 tiles x 3 contractions, each on both clusters); B = 4, K = 1 or 4: 64 or 256
    blocks filled. fp8 (DeepSeek-V3's 128 x 128 block-scaled experts, both of them
    `tcp.scaled_contract`s, the shared expert's inputs quantized per row group in its loop):
    FS = 256 in one tile (3 contractions); B = 8, K = 2: 64 blocks filled, the routed
    contraction at 8 FLOPs per stored weight byte, below RNGD's fp8 peak over HBM bandwidth.
    The IR before and after the pass gives the same bits, the reference's."""
    dims, contractions, filled = SPREAD_CASES[example]
    program = tcpc.compile_file(EXAMPLES / f"{example}.moe", dims=dims)
    before = program.run(seed=4, pipeline=SPLIT).outputs
    after = program.run(seed=4, pipeline=SPLIT + ",interleave-shared").outputs
    assert_same_bits(after, before)
    assert_same_bits(after, program.run(seed=4).outputs)
    order = _top_level(program, SPLIT + ",interleave-shared")
    assert "shared loop" not in order
    assert order.count("shared") == 2 * contractions  # every contraction, on both clusters
    pieces = [o for o in order if o.startswith("routed")]
    # Runs of shared contractions (one per cluster, or two where a tile's down-projection meets
    # the next tile's first contraction), each before a piece of the routed loop.
    assert order[0] == "shared" and order[-1].startswith("routed") and len(pieces) >= 2
    assert all(a != b for a, b in zip(order, order[1:]) if a.startswith("routed"))
    bounds = [tuple(int(b) for b in p.split()[1].split("-")) for p in pieces]
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])) and bounds[0][0] == 0
    assert bounds[-1][0] < filled < bounds[-1][1]  # the filled blocks spread, the last piece to G


def test_decode_and_a_routed_loop_bound_by_its_contractions_keep_the_shared_loop() -> None:
    """T = 1: one row block, nothing to spread. T = 256, B = 256: the routed contraction does
    256 FLOPs per weight byte, above RNGD's 175 (peak over HBM bandwidth), so the routed loop
    has no idle tensor time for the shared expert."""
    for dims in ({"T": 1, "B": 1}, {"T": 256, "B": 256}):
        program = tcpc.compile_file(EXAMPLES / "llama4.moe", dims={**dims, "D": 16, "FS": 1100})
        assert _top_level(program, SPLIT + ",interleave-shared") == _top_level(program, SPLIT)
        assert "shared loop" in _top_level(program, SPLIT)


def test_a_shared_expert_spreads_at_prefill_through_a_routed_loop_that_waits_for_hbm() -> None:
    rngd = default_machine()
    program = tcpc.compile_file(EXAMPLES / "llama4.moe", dims={"T": 256, "D": 16, "FS": 1100, "B": 4})
    module = program.lower(",".join(LOWERED_PIPELINE))
    routed = next(op for op in module.walk() if isinstance(op, tcp.ContractOp) and phase_of(op) == "experts")
    assert spreads(2, routed, rngd) and not spreads(1, routed, rngd)  # 4 FLOPs a byte
    wide = tcpc.compile_file(EXAMPLES / "llama4.moe", dims={"T": 256, "D": 16, "FS": 1100, "B": 176})
    module = wide.lower(",".join(LOWERED_PIPELINE))
    routed = next(op for op in module.walk() if isinstance(op, tcp.ContractOp) and phase_of(op) == "experts")
    assert not spreads(2, routed, rngd)  # 176 FLOPs a byte: more than RNGD's 174.8


@pytest.mark.parametrize(("block", "spread"), [(128, True), (176, False)])
def test_a_block_scaled_routed_loop_is_judged_at_the_fp8_rate_and_its_stored_bytes(block: int, spread: bool) -> None:
    """DeepSeek-V3 fp8's routed contraction does 2 B FLOPs per stored byte (f8e4m3, plus an f32
    scale per 128 x 128 block): at B = 128, 256, more than RNGD's bf16 peak over HBM bandwidth
    (174.8) but less than its fp8 peak's (349.6), so the shared expert spreads; at B = 176,
    352 FLOPs a byte, it does not."""
    program = tcpc.compile_file(EXAMPLES / "deepseek_v3_fp8.moe", dims={"T": 256, "D": 128, "F": 128, "FS": 256, "B": block})
    module = program.lower(",".join(LOWERED_PIPELINE))
    routed = next(op for op in module.walk() if isinstance(op, tcp.ScaledContractOp) and phase_of(op) == "experts")
    assert 2 * block * (1 - 1e-3) < contraction_flops_per_weight_byte(routed) < 2 * block
    assert spreads(2, routed, default_machine()) is spread


def test_the_report_lists_the_routed_loops_pieces_as_one_loop() -> None:
    """tile_loops (the report's `schedule:` lines and JSON `loops`) gives the routed loop's
    pieces as one loop over all its blocks, `in N pieces`, not one line per piece."""
    from tcpc.schedule_summary import tile_loops

    program = tcpc.compile_file(EXAMPLES / "llama4.moe", dims={"T": 256, "D": 16, "FS": 1100, "B": 4})
    module = program.lower(SPLIT + ",interleave-shared")
    pieces = _top_level(program, SPLIT + ",interleave-shared")
    routed = [p for p in pieces if p.startswith("routed")]
    assert len(routed) > 1
    experts = [loop for loop in tile_loops(module, "llama4") if loop.phase == "experts"]
    first, last = routed[0].split()[1].split("-"), routed[-1].split()[1].split("-")
    assert [(loop.pieces, loop.iterations) for loop in experts] == [(len(routed), int(last[1]) - int(first[0]))]
    assert f"in {len(routed)} pieces" in experts[0].describe()


def test_the_pass_only_reorders_the_commands_so_a_bound_before_it_holds_after_it() -> None:
    """`interleaves` says whether the pass changes the IR. What it changes is the commands'
    order only: cost-only, the same commands with the same costs (so LowerBoundBar's bound, on
    which the cost model rules a block candidate out before building its pieces, is the same),
    and the pass applied to the IR compiled up to it is the IR of the whole pipeline."""
    import math
    from collections import Counter

    from runtime_sim.perf.cost_only import LowerBoundBar, cost_only_run
    from tcpc.autotune import compiled_cost_only
    from tcpc.pipelines import apply_pipeline, parse_pipeline, pipeline_spec
    from tcpc.program import print_ir

    machine = default_machine()
    for dims, spread in (({"T": 256, "D": 16, "FS": 1100, "B": 4}, True), ({"T": 1, "D": 16, "FS": 1100, "B": 1}, False)):
        program = tcpc.compile_file(EXAMPLES / "llama4.moe", dims=dims)
        name = program.function().sym_name.data
        passes = parse_pipeline(pipeline_spec(topk_strategy="rank", expert_order="block"))
        at = [p.name for p in passes].index("interleave-shared")
        assert [p.name for p in passes[at:]] == ["interleave-shared", "interleave-chunks", "return-waves"]
        before = compiled_cost_only(program.module, passes[:at], machine)
        after = compiled_cost_only(program.module, passes, machine)
        assert interleaves(before) is spread and not interleaves(after)
        assert (print_ir(before) != print_ir(after)) is spread
        assert print_ir(apply_pipeline(before, passes[at:], machine=machine)) == print_ir(after)
        runs = [cost_only_run(m, name, machine, keep_below=math.inf) for m in (before, after)]
        traces = [r.trace for r in runs if r.trace is not None]
        assert len(traces) == 2
        assert Counter((t.name, t.cost) for t in traces[0].ops) == Counter((t.name, t.cost) for t in traces[1].ops)
        assert LowerBoundBar(machine, math.inf).least(traces[0]) == LowerBoundBar(machine, math.inf).least(traces[1])


def test_a_mesh_chips_one_block_shared_expert_shares_the_clusters_and_keeps_the_bits(tmp_path: Path) -> None:
    """At decode a mesh chip's shared loop runs one block: 128 tokens a chip on 8 chips, FS =
    1,024 in two F tiles of 512 (a test chip of 1 KB of SRAM a slice, so that small dims tile).
    Its block does 128 FLOPs per weight byte, more than a cluster's peak over HBM's bandwidth,
    so the second tile's gate and up projections go to cluster 0 and their hidden rows cross
    to cluster 1 by one `tile.copy`, before the second down projection; its result's store
    follows the routed loop. Every chip's outputs are one chip's bits."""
    (tmp_path / "chip.toml").write_text(
        'extends = "rngd"\nname = "rngd-small-sram"\ndescription = "RNGD with 1 KB of SRAM a slice"\n'
        '[sram]\nbytes_per_slice = { value = 1024, assumption = "a test chip: F tiles at small dims" }\n')
    (tmp_path / "mesh.toml").write_text('extends = "rngd_pcie"\nname = "small-sram-pcie"\n'
                                        'description = "RNGD cards of 1 KB SRAM slices"\nchip = "chip.toml"\n')
    program = tcpc.compile_file(EXAMPLES / "deepseek_v3.moe", dims={"T": 1024, "D": 64, "FS": 1024})
    sim = simulate_on_mesh(program, MeshSpec.parse("ep=8"), seed=3, machine=tmp_path / "mesh.toml")
    assert all(c.identical for c in compare_outputs(sim.outputs, program.run(seed=3).outputs))
    body = next(op for op in sim.module.walk() if isinstance(op, func.FuncOp)).body.block
    assert not any(isinstance(op, scf.ForOp) and phase_of(op) == "shared" for op in body.ops)
    (copy,) = [op for op in body.ops if isinstance(op, tile.CopyOp) and phase_of(op) == "shared"]
    down = next(iter(copy.result.uses)).operation
    assert isinstance(down, tcp.ContractOp) and cluster_of(down) == cluster_of(copy) == 1
    assert cluster_of(copy.operands[0].owner) == 0
    shared = [op for op in body.ops if isinstance(op, tcp.ContractOp) and phase_of(op) == "shared"]
    assert [cluster_of(op) for op in shared] == [1, 1, 1, 0, 0, 1]
    routed = [op for op in body.ops if isinstance(op, scf.ForOp) and phase_of(op) == "experts"]
    stores = [op for op in body.ops if isinstance(op, tile.StoreOp) and phase_of(op) == "shared"]
    assert len(stores) == 1 and list(body.ops).index(stores[0]) > list(body.ops).index(routed[-1])


def test_a_chip_gathering_over_sp_loads_its_shared_down_projections_after_the_reduce_scatter() -> None:
    """DeepSeek-V3 at 2 tokens a chip on ep=2,sp=2 (a2a_sum): the shared expert's gate and up
    weights load before the routing, its down projection's from its weights on after the
    combine's reduce-scatter over sp; its result stays in SRAM (no store to HBM, no load back:
    `_keep_result_in_sram`); the outputs keep their bits."""
    program = tcpc.compile_file(EXAMPLES / "deepseek_v3.moe", dims={"T": 8})
    spec = MeshSpec.parse("ep=2,sp=2,strategy=a2a_sum")
    after = spec.pipeline()
    before = ",".join(p for p in after.split(",") if p != "interleave-shared")
    modules = [program.lower(pipeline) for pipeline in (before, after)]
    body = next(op for op in modules[1].walk() if isinstance(op, func.FuncOp)).body.block
    ordered = list(body.ops)
    at = {name: next(i for i, op in enumerate(ordered) if op.name == name) for name in ("ccl.reduce_scatter", "scf.for")}
    loads = [(i, op) for i, op in enumerate(ordered) if isinstance(op, tile.LoadExpertOp) and phase_of(op) == "shared"]
    assert [i < at["scf.for"] for i, _ in loads] == [True, True, False]
    assert loads[-1][0] > at["ccl.reduce_scatter"]
    assert not [op for op in ordered if isinstance(op, (tile.StoreOp, tcp.LoadOp)) and phase_of(op) == "shared"]
    unmoved, moved = mesh_outputs(program, spec, modules, 3)
    assert_same_bits(moved, unmoved)
