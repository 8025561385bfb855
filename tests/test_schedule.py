"""The schedule level (passes/schedule/schedule_experts.py, passes/schedule/schedule_tokens.py): translation
validation against the lowered IR and the graph-level reference, and what its loops cost."""

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import assert_same_bits

import tcpc
from dialects.annotations import cluster_of, phase_of
from dialects.moe import max_blocks
from dialects.tensor_types import shape_of
from runtime_sim.perf.cost_only import simulate_cost_only
from runtime_sim.perf.report import SimReport
from tcpc.pipelines import FULL_PIPELINE, LOWERED_PIPELINE
from tcpc.program import compile_source, function_in
from passes._loop_builder import constant_index
from xdsl.dialects import scf
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.moe"))
LOWERED = ",".join(LOWERED_PIPELINE)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_is_bit_identical_before_and_after_each_schedule_pass(path: Path) -> None:
    program = tcpc.compile_file(path)
    reference = program.run(seed=3).outputs
    lowered = program.run(seed=3, pipeline=LOWERED).outputs
    experts = program.run(seed=3, pipeline=LOWERED + ",schedule-experts").outputs
    scheduled = program.run(seed=3, pipeline=",".join(FULL_PIPELINE)).outputs
    assert_same_bits(experts, lowered)
    assert_same_bits(scheduled, lowered)
    assert_same_bits(scheduled, reference)


F_TILE_MODES = {"whole": "", "resident": "{f_tile=512}", "streamed": "{sram_bytes=100000}"}
"""schedule-experts options: F whole (the default at these sizes), F tiles of 512 kept across an
expert's blocks, and F tiles of 512 streamed (SRAM too small to keep them)."""


@settings(max_examples=10, deadline=None)
@given(tokens=st.integers(1, 40), block=st.sampled_from([1, 2, 4, 8]), experts=st.sampled_from([4, 8]),
       k=st.integers(1, 3), tile_bytes=st.sampled_from([20000, 60000, 1 << 20]), seed=st.integers(0, 5),
       f=st.sampled_from([8, 600, 1100]), f_mode=st.sampled_from(sorted(F_TILE_MODES)),
       clusters=st.sampled_from([1, 2, 4]))
def test_tile_remainders_are_exact(tokens: int, block: int, experts: int, k: int, tile_bytes: int, seed: int,
                                   f: int, f_mode: str, clusters: int) -> None:
    """T not a multiple of the token tile (tiles balanced over 1, 2 or 4 clusters), G blocks
    with unused ones, F not a multiple of the F tile: still the reference's bits."""
    dims = {"T": tokens, "B": min(block, tokens), "E": experts, "K": min(k, experts), "D": 16, "F": f}
    program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / "qwen3_moe.moe", dims=dims)
    pipeline = f"{LOWERED},schedule-experts{F_TILE_MODES[f_mode]},schedule-tokens{{tile_bytes={tile_bytes} clusters={clusters}}}"
    assert_same_bits(program.run(seed=seed, pipeline=pipeline).outputs, program.run(seed=seed).outputs)


BF16_EXAMPLES = [p for p in EXAMPLES if p.stem in ("deepseek_v3", "gpt_oss", "llama4", "mixtral", "qwen3_moe", "toy")]


@pytest.mark.parametrize("path", BF16_EXAMPLES, ids=[p.stem for p in BF16_EXAMPLES])
def test_every_example_is_bit_identical_with_streamed_f_tiles(path: Path) -> None:
    """F = 1100 in tiles of 512, 512 and 76, streamed: the full pipeline gives the reference's
    bits (biases, shared experts, every activation)."""
    program = tcpc.compile_file(path, dims={"D": 16, "F": 1100})
    pipeline = f"{LOWERED},schedule-experts{F_TILE_MODES['streamed']},schedule-tokens,fuse-ve-chains"
    scheduled = program.lower(pipeline)
    starts = [max(op.window_offsets()) for op in scheduled.walk() if op.name == "tile.load_expert" and op.offsets]
    assert starts and sorted(set(starts)) == [0, 512, 1024] and len(starts) % 3 == 0  # three tiles of each weight
    assert_same_bits(program.run(seed=4, pipeline=pipeline).outputs, program.run(seed=4).outputs)



def test_streamed_tiles_store_a_blocks_results_after_the_next_blocks_loads() -> None:
    """Streamed F tiles: a block's results are stored by the next block that runs, right after
    its last tile's weight loads (stored at the end of its own block, a store held a DMA engine
    idle until that block's last contraction, and the loads issued after it could not use the
    engine); the last block stores its own. On both clusters, with unused blocks: the
    reference's bits. Blocks of 4 rows are weight-bound on RNGD (`weight_bound`: decode, where each
    block stores its own), so the test's machine has 100x RNGD's HBM bandwidth."""
    program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / "qwen3_moe.moe",
                                dims={"T": 20, "D": 16, "F": 1100, "E": 4, "K": 2, "B": 4})
    machine = Path(__file__).parent / "filecheck" / "schedule" / "schedule_experts" / "fast_hbm.toml"
    assert "y_blocked_flushed" not in str(program.lower(f"{LOWERED},schedule-experts{F_TILE_MODES['streamed']}"))
    module = program.lower(f"{LOWERED},schedule-experts{F_TILE_MODES['streamed']}", machine=machine)
    loop = next(op for op in module.walk() if isinstance(op, scf.ForOp) and op.body.block.args[0].name_hint == "block")
    runs = next(op for op in loop.body.block.ops if isinstance(op, scf.IfOp))
    body = list(runs.true_region.block.ops)
    names = [op.results[0].name_hint if op.results else None for op in body]
    flushed = names.index("y_blocked_flushed")
    loads = [i for i, op in enumerate(body) if op.name == "tile.load_expert"]
    contractions = [i for i, op in enumerate(body) if op.name == "tcp.contract"]
    assert loads[-1] < flushed < contractions[-1]
    assert [op.name for op in runs.false_region.block.ops][-2:] == ["scf.if", "scf.yield"]  # the last flushes
    full = ",".join(FULL_PIPELINE).replace("schedule-experts", f"schedule-experts{F_TILE_MODES['streamed']}")
    assert_same_bits(program.simulate(seed=6, pipeline=full, machine=machine).outputs, program.run(seed=6).outputs)

def cost_only(path: str, dims: dict[str, int], routing: str = "balanced"):
    program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / path, dims=dims)
    module = program.lower("pin-routing," + ",".join(FULL_PIPELINE))
    return simulate_cost_only(module, program.function().sym_name.data, routing=routing).report


def assert_fits(report: SimReport) -> None:
    """The compiler's placement fits by construction: no spill, no stream, and each cluster's
    buffers within its own SRAM (its engines read no other)."""
    assert not report.spills and not report.streams
    assert len(report.cluster_peak_sram_bytes) == report.machine.clusters
    assert max(report.cluster_peak_sram_bytes) <= report.machine.cluster_sram_bytes
    assert report.peak_sram_bytes <= report.machine.sram_bytes


QWEN3_SMALL_PREFILL = dict(T=256, D=256, F=128, E=16, K=4, B=16)


def test_each_expert_is_loaded_once_per_run_of_its_blocks() -> None:
    """Balanced routing, 64 pairs per expert in blocks of 16: each of the 16 experts' three
    weights is fetched once, and the other 3 blocks of each expert reuse it. Every one of the
    G blocks is guarded; the unused ones (G - 64) stop at their guard."""
    report = cost_only("qwen3_moe.moe", QWEN3_SMALL_PREFILL)
    loads = [o for o in report.ops if o.name == "tile.load_expert"]
    fetched = [o for o in loads if o.hbm_bytes > 0]
    d = QWEN3_SMALL_PREFILL
    clusters = report.machine.clusters
    # every cluster guards every block (a block whose expert another cluster owns, or no expert, is skipped whole)
    assert len([o for o in report.ops if o.name == "tile.guard"]) == clusters * max_blocks(d["T"], d["K"], d["E"], d["B"])
    assert len(loads) == 3 * 16 * 4  # one per weight per used block, on the cluster that owns its expert
    assert len(fetched) == 3 * 16
    assert all(o.hbm_bytes >= 256 * 128 * 2 for o in fetched)


def test_a_reused_weight_tile_is_passed_through() -> None:
    """A block of the previous block's expert reuses its weight tile: the guard deciding so does
    not wait for that tile to arrive (on a DMA engine it held the engine, and the next expert's
    load, issued after it, queued behind it) and takes no new SRAM; the contraction reading the
    tile waits for the load that fetched it."""
    program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / "qwen3_moe.moe", dims=QWEN3_SMALL_PREFILL)
    module = program.lower("pin-routing," + ",".join(FULL_PIPELINE))
    trace = simulate_cost_only(module, program.function().sym_name.data, routing="balanced").trace
    assert trace is not None
    ops = trace.ops

    def fetches(i: int) -> bool:
        return ops[i].name == "tile.load_expert" and ops[i].cost.bound != "guard (reused)"

    reused = {t.index for t in ops if t.name == "tile.load_expert" and t.cost.bound == "guard (reused)"}
    assert len(reused) == 3 * 16 * 3  # each expert's 3 weights, in the 3 blocks after its first
    assert all(not any(fetches(d) for d in ops[i].deps) and not ops[i].writes for i in reused)
    readers = [t for t in ops if t.name == "tcp.contract" and reused & set(t.deps)]
    assert readers and all(any(fetches(d) for d in t.deps) for t in readers)


def test_the_clusters_split_the_experts_and_contract_at_once() -> None:
    """split-clusters: each expert's blocks contract on the cluster that owns it (e mod 2), the
    two tensor units work side by side, and the chip beats one cluster (a compute-bound layer:
    16 blocks per expert)."""
    dims = dict(T=1024, D=256, F=256, E=4, K=2, B=64)
    report = cost_only("qwen3_moe.moe", dims)
    running = [o for o in report.ops if o.name == "tcp.contract" and o.phase == "experts" and o.flops]
    units = {o.unit for o in running}
    assert units == {0, 1}
    on = {u: [(o.start, o.end) for o in running if o.unit == u] for u in units}
    overlapping = sum(1 for s, e in on[1] if any(s0 < e and s < e0 for s0, e0 in on[0]))
    assert overlapping > 0  # at these small sizes the row loads, not the contractions, pace the loop
    program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / "qwen3_moe.moe", dims=dims)
    one = program.simulate(cost_only=True, routing="balanced", machine="rngd-cluster").report
    assert one.machine.clusters == 1
    def loop(r: SimReport) -> int:  # the expert loop's phases: its row gathers and its experts
        return sum(p.critical_cycles for p in r.phases if p.name in ("dispatch", "experts"))

    assert loop(report) < loop(one) and report.total_cycles < one.total_cycles


def test_two_clusters_streaming_f_tiles_contract_at_once() -> None:
    """Weights too large to stay resident stream in F tiles. A block of 512 bf16 rows does
    512 FLOPs per weight byte (its contraction on one cluster outlasts its load at the whole
    HBM bandwidth from 88), so each cluster's
    copy runs its DMA on its own four engines (tcpc.own_dma): neither cluster's prefetched
    loads book the other's engines, the clusters contract at once, and the whole chip takes
    little more than half one cluster's time. With the engines shared (own_dma_intensity=0),
    the first cluster's loads of a block, issued first, queue the second's behind them."""
    dims = dict(D=2048, F=16384, E=8, K=2, T=2048, B=512)
    program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / "mixtral.moe", dims=dims)
    chip = program.simulate(cost_only=True, routing="balanced").report
    one = program.simulate(cost_only=True, routing="balanced", machine="rngd-cluster").report
    assert chip.total_cycles < 0.55 * one.total_cycles
    shared = program.simulate(cost_only=True, routing="balanced",
                              pipeline=program.full_pipeline().replace("split-clusters", "split-clusters{own_dma_intensity=0}"))
    assert shared.report.total_cycles > 0.7 * one.total_cycles


def test_token_tiles_are_balanced_over_the_clusters() -> None:
    """schedule-tokens shares the tokens evenly among as many tiles as SRAM needs, rounded up
    to a multiple of the clusters (a multiple of 8 rows each)."""
    from passes.schedule.schedule_tokens import balanced_rows

    assert balanced_rows(2048, 1712, 2) == 1024      # 1712 + 336 before
    assert balanced_rows(4096, 1712, 2) == 1024      # 3 tiles -> 4
    assert balanced_rows(360, 360, 2) == 184         # fits whole: a tile per cluster
    assert balanced_rows(20, 8, 2) == 5 and balanced_rows(100, 100, 1) == 100


def test_the_pipeline_writes_no_machine_number() -> None:
    """The passes read the machine from the module's target, so the pipeline is the same for
    every machine; the machine-derived figures the passes compute are RNGD's on RNGD."""
    from target.chunked_scan import scan_rows_of
    from passes.schedule.split_clusters import own_dma_intensity
    from target.machine import default_machine
    from tcpc.pipelines import FULL_PIPELINE, pipeline_spec

    rngd = default_machine()
    assert own_dma_intensity(rngd) == 88
    assert scan_rows_of(rngd) == 2048 and scan_rows_of(replace(rngd, slices=128)) == 1024
    assert pipeline_spec(topk_strategy="rank") == ",".join(FULL_PIPELINE).replace("lower-topk", "lower-topk{strategy=rank}")
    assert pipeline_spec() == ",".join(FULL_PIPELINE).replace("lower-topk", "lower-topk{strategy=auto}")


@pytest.mark.parametrize("clusters", [1, 2, 4])
def test_split_clusters_is_bit_identical(clusters: int) -> None:
    dims = dict(T=24, D=16, F=8, E=8, K=2, B=4)
    program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / "qwen3_moe.moe", dims=dims)
    before = program.run(seed=1, pipeline=LOWERED + ",schedule-experts").outputs
    after = program.run(seed=1, pipeline=LOWERED + f",schedule-experts,split-clusters{{clusters={clusters}}}").outputs
    assert_same_bits(after, before)


def test_dma_overlaps_the_contractions() -> None:
    report = cost_only("qwen3_moe.moe", QWEN3_SMALL_PREFILL)
    contracts = [(o.start, o.end) for o in report.ops if o.name == "tcp.contract" and o.phase == "experts"]
    # The loads that move data (a reused expert's load_expert is its guard alone, not a transfer).
    loads = [(o.start, o.end) for o in report.ops
             if o.name in ("tile.gather", "tile.load_expert") and o.hbm_bytes > 0]
    overlapping = sum(1 for s, e in loads if any(cs < e and s < ce for cs, ce in contracts))
    assert len(loads) == 64 + 3 * 16 and overlapping >= len(loads) // 2


@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_decode_at_real_dims_needs_no_spill_or_stream(tokens: int) -> None:
    assert_fits(cost_only("qwen3_moe.moe", dict(T=tokens, D=2048, F=768, E=128, K=8, B=1)))


MIXTRAL_DECODE = dict(T=1, D=4096, F=14336, E=8, K=2, B=1)
"""Mixtral-8x7B's real dims at T = 1: the smallest T, every weight at its full size (117 MB, more
than a cluster's SRAM holds three of), so the whole F-tiled schedule runs, cost-only."""


def test_mixtral_at_real_dims_streams_f_tiles_with_no_spill_or_stream() -> None:
    report = cost_only("mixtral.moe", MIXTRAL_DECODE)
    assert_fits(report)
    fetched = [o for o in report.ops if o.name == "tile.load_expert" and o.hbm_bytes > 0]
    assert sum(o.hbm_bytes for o in fetched) == 2 * 3 * 4096 * 14336 * 2  # the 2 used experts' weights, once
    assert len(fetched) >= 2 * 3 * 4 and len({o.hbm_bytes for o in fetched}) == 1  # in equal F tiles
    contracts = [(o.start, o.end) for o in report.ops if o.name == "tcp.contract" and o.phase == "experts"]
    overlapping = sum(1 for o in fetched if any(s < o.end and o.start < e for s, e in contracts))
    assert overlapping >= len(fetched) // 2  # the next tiles arrive while the current one contracts


TOKEN_TILE_LAYERS = {
    "qwen3_moe": dict(T=20, D=16, F=8, E=8, K=2, B=4),
    "deepseek_v3": dict(T=37),
    "mixtral": dict(T=45),
}
"""Small layers whose token tiles leave remainders (tile_bytes below picks the tile): rounds of
one tile per cluster with and without leftover tiles and a partial remainder, and fewer tiles
than clusters (Qwen3 in 8-row tiles on 4 clusters: no loop, two leftovers and the remainder)."""


@pytest.mark.parametrize(("family", "clusters", "tile_bytes"), [
    ("qwen3_moe", 2, 20000), ("qwen3_moe", 4, 20000), ("qwen3_moe", 4, 100000), ("deepseek_v3", 2, 60000),
    ("deepseek_v3", 4, 200000), ("mixtral", 2, 30000)])
def test_token_tiles_on_clusters_are_bit_identical(family: str, clusters: int, tile_bytes: int) -> None:
    """split-clusters puts token tile i on cluster i mod N (rounds of N tiles, the leftovers and
    the remainder after the loop, copies between the clusters): the outputs keep the bits of
    the same tiles on one cluster and of the reference."""
    program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / f"{family}.moe", dims=TOKEN_TILE_LAYERS[family])
    tiled = f"{LOWERED},schedule-experts,schedule-tokens{{tile_bytes={tile_bytes}}}"
    split = f"{tiled},split-clusters{{clusters={clusters}}},fuse-ve-chains"
    pinned = {cluster_of(op) for op in program.lower(split).walk() if op.name in ("ve.sigmoid", "ve.exp")}
    assert {0, clusters - 1} <= pinned  # the router's tiles run on several clusters
    after = program.run(seed=5, pipeline=split).outputs
    assert_same_bits(after, program.run(seed=5, pipeline=tiled).outputs)
    assert_same_bits(after, program.run(seed=5).outputs)


DEEPSEEK_V3_PREFILL = dict(T=4096, D=7168, F=2048, FS=2048, E=256, K=8, NG=8, TG=4, B=128)
"""DeepSeek-V3's layer at T = 4096, real dims, the block its cost model chooses."""


def test_deepseek_v3_router_at_real_dims_needs_no_spill_or_stream() -> None:
    """DeepSeek-V3's group-limited router at T = 2048 (real dims): one token loop, every value
    in SRAM by construction (it needed 172 spills and 8 streams when its views split it)."""
    dims = dict(T=2048, D=7168, F=2048, FS=2048, E=256, K=8, NG=8, TG=4, B=64)
    assert_fits(cost_only("deepseek_v3.moe", dims))


def test_each_cluster_keeps_its_buffers_in_its_own_sram_at_deepseek_v3_prefill() -> None:
    """DeepSeek-V3 at T = 4096 (real dims): a buffer lives in the SRAM of its producer's
    cluster, whose engines read it (the book: each slice fetches from its own DM), so neither
    cluster holds more than its own 128 MB, and no computing command reads the other
    cluster's SRAM nor stores into it (split-clusters copies what crosses by DMA), so the plan
    adds no copy.
    With SRAM one pool, the plan kept five of cluster 0's buffers, 116 MB, in cluster 1's; in
    cluster 0's alone they fit by the schedule level's tiles (the tokens and the shared
    expert's rows loaded a tile at a time, the output summed in the combine's loop, stored to
    HBM a tile at a time, T x D bf16 in all)."""
    report = cost_only("deepseek_v3.moe", DEEPSEEK_V3_PREFILL)
    assert_fits(report)
    assert not [s for s in report.streams if s.direction in ("cluster", "store")]
    stores = [o for o in report.ops if o.phase == "combine" and o.name == "tile.store"]
    assert sum(o.hbm_bytes for o in stores) == 4096 * 7168 * 2


def test_the_whole_chip_runs_the_token_loops_faster_than_one_cluster() -> None:
    """A layer whose time is mostly its router (DeepSeek-V3's ranking over 128 experts, tiny
    experts): the router's token tiles run on both clusters' vector engines, and the chip is
    faster than one cluster (machines/rngd-cluster.toml), the router phase most of all. The
    ranking strategy is fixed (auto takes rounds here, whose vector work is too small to split)."""
    from tcpc.pipelines import pipeline_spec

    dims = dict(T=1024, D=64, F=32, FS=32, E=128, K=8, NG=8, TG=4, B=16)
    program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / "deepseek_v3.moe", dims=dims)
    chip, one = (program.simulate(cost_only=True, routing="balanced", machine=m,
                                  pipeline=pipeline_spec(topk_strategy="rank")).report
                 for m in ("rngd", "rngd-cluster"))
    assert chip.machine.clusters == 2 and one.machine.clusters == 1
    ranking = [o for o in chip.ops if o.name.startswith("ve.") and o.phase == "router" and o.cycles > 0]
    assert {o.unit for o in ranking} == {0, 1}
    router = {p.name: p.critical_cycles for p in chip.phases}["router"]
    assert router < 0.75 * {p.name: p.critical_cycles for p in one.phases}["router"]
    assert chip.total_cycles < one.total_cycles


LOW_PRECISION_F_TILES = {
    "qwen3_moe_fp8": dict(D=256, F=1280, E=4, K=2),
    "deepseek_v3_fp8": dict(F=1280, FS=1280),
    "gpt_oss_mxfp4": dict(D=64, F=1088, E=4, K=2),
}
"""Block-scaled examples with F = 1280 (fp8, 128 x 128 blocks) or 1088 (MXFP4, 32 along K):
tiles of 512, 512 and a remainder of 256 or 64."""


@pytest.mark.parametrize("mode", ["resident", "streamed"])
@pytest.mark.parametrize("stem", sorted(LOW_PRECISION_F_TILES))
def test_block_scaled_f_tiles_are_bit_identical(stem: str, mode: str) -> None:
    """fp8 and MXFP4 experts in F tiles: the up-projections' columns of the weights and their
    scales, the quantization of h group by group, the down-projection continuing the previous
    tile's sum (`acc`): the lowered program's bits before and after schedule-experts, and the
    reference's after the full schedule level."""
    program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / f"{stem}.moe",
                                dims=LOW_PRECISION_F_TILES[stem])
    pipeline = f"{LOWERED},schedule-experts{F_TILE_MODES[mode]}"
    module = program.lower(pipeline)
    continued = [op for op in module.walk() if op.name == "tcp.scaled_contract" and op.acc is not None]
    assert len(continued) >= 2  # every tile after the first continues the down-projection's sum
    lowered = program.run(seed=5, pipeline=LOWERED).outputs
    assert_same_bits(program.run(seed=5, pipeline=pipeline).outputs, lowered)
    full = ",".join(FULL_PIPELINE).replace("schedule-experts", f"schedule-experts{F_TILE_MODES[mode]}")
    assert_same_bits(program.run(seed=5, pipeline=full).outputs, program.run(seed=5).outputs)


@settings(max_examples=6, deadline=None)
@given(tokens=st.integers(1, 24), block=st.sampled_from([1, 2, 4]), k=st.integers(1, 2), seed=st.integers(0, 5),
       f=st.sampled_from([128, 640, 1152]), mx=st.booleans(), f_mode=st.sampled_from(sorted(F_TILE_MODES)))
def test_block_scaled_tile_remainders_are_exact(tokens: int, block: int, k: int, seed: int, f: int, mx: bool,
                                                f_mode: str) -> None:
    """Qwen3's SwiGLU in fp8 (128 x 128 blocks) or MXFP4 (32 along K), F whole or in tiles of
    512 with a remainder of 128, unused blocks, T not a multiple of the token tile: the
    reference's bits after the whole schedule level."""
    dims = {"T": tokens, "B": min(block, tokens), "E": 4, "K": k, "D": 128, "F": f,
            **(dict(QK=32, QN=1, QG=32) if mx else {})}
    source = (Path(__file__).parent.parent / "examples" / "qwen3_moe_fp8.moe").read_text()
    if mx:
        source = source.replace("f8e4m3[E", "f4e2m1[E").replace("f32[E", "e8m0[E")
    program = tcpc.compile_source(source, dims=dims)
    full = ",".join(FULL_PIPELINE).replace("schedule-experts", f"schedule-experts{F_TILE_MODES[f_mode]}")
    assert_same_bits(program.run(seed=seed, pipeline=full).outputs, program.run(seed=seed).outputs)


def test_small_weight_scales_are_gathered_once_before_the_expert_loop() -> None:
    """fp8's 128 x 128 block scales (a few hundred bytes per expert and matrix) are gathered for
    every block in one DMA command each before the loop, which addresses its block's rows (and
    each F tile its window) in place; so are MXFP4's (one per 32 weights) where an expert's
    fit in a DMA start-up's worth of transfer (RNGD: 128 KB; D = 2048, F = 1088: 68 KB), and
    beyond it (D = 4096: 136 KB) where the loop streams its weights (blocks of a few rows);
    with blocks of 32 rows, whose contractions outlast their loads, those load with their expert."""
    def scale_loads(stem: str, dims: dict[str, int]) -> tuple[int, int]:
        program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / f"{stem}.moe", dims=dims)
        module = program.lower(f"{LOWERED},schedule-experts{{f_tile=512}}")
        ahead = [op for op in module.walk() if op.name == "tcp.dma_gather" and "scale" in op.source.name_hint]
        inside = [op for op in module.walk() if op.name == "tile.load_expert" and "scale" in op.source.name_hint
                  and "_guessed" not in (op.result.name_hint or "")]  # (T = 8: 4 pairs per expert, guessed too)
        return len(ahead), len(inside)

    assert scale_loads("qwen3_moe_fp8", LOW_PRECISION_F_TILES["qwen3_moe_fp8"]) == (3, 0)
    assert scale_loads("gpt_oss_mxfp4", dict(T=4, D=2048, F=1088, E=4, K=2)) == (3, 0)
    assert scale_loads("gpt_oss_mxfp4", dict(T=4, D=4096, F=1088, E=4, K=2)) == (3, 0)
    wide = tcpc.compile_file(Path(__file__).parent.parent / "examples" / "gpt_oss_mxfp4.moe",
                             dims=dict(T=2, B=1, D=4096, F=1088, E=4, K=2))
    assert_same_bits(wide.run(seed=1, pipeline=f"{LOWERED},schedule-experts{{f_tile=512}}").outputs,
                     wide.run(seed=1, pipeline=LOWERED).outputs)
    assert scale_loads("gpt_oss_mxfp4", dict(T=32, B=32, D=2048, F=1088, E=4, K=2)) == (3, 0)
    ahead, inside = scale_loads("gpt_oss_mxfp4", dict(T=32, B=32, D=4096, F=1088, E=4, K=2))
    assert ahead == 0 and inside == 3 * 3  # three tiles of each of the three weights' scales


@pytest.mark.parametrize("stem, dims, streams", [("gpt_oss", {"T": 1, "B": 1}, True),
                                                 ("gpt_oss_mxfp4", {"T": 1, "B": 1}, True),
                                                 ("gpt_oss", {"T": 8, "B": 4}, True),
                                                 ("gpt_oss", {"T": 256, "B": 128}, False)])
def test_biases_are_gathered_once_before_a_loop_that_streams_its_weights(stem: str, dims: dict[str, int],
                                                                         streams: bool) -> None:
    """gpt-oss's biases (a row of F or D per expert and matrix: 5.6 KB at its real size, a DMA
    command of mostly start-up) are gathered for every block in one command each before a loop
    that streams its weights (blocks of a few rows), which slices its block's row; with blocks
    of 128 rows, whose contractions outlast their loads, they load with their expert. The
    lowered program's bits either way."""
    program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / f"{stem}.moe", dims=dims)
    pipeline = f"{LOWERED},schedule-experts"
    module = program.lower(pipeline)
    ahead = [op for op in module.walk() if op.name == "tcp.dma_gather" and op.source.name_hint.startswith("b_")]
    inside = [op for op in module.walk() if op.name == "tile.load_expert" and op.source.name_hint.startswith("b_")]
    assert (len(ahead), bool(inside)) == ((3, False) if streams else (0, True))
    assert_same_bits(program.run(seed=4, pipeline=pipeline).outputs, program.run(seed=4, pipeline=LOWERED).outputs)


def test_large_weight_scales_go_ahead_of_the_loop_where_they_fit_and_the_weights_stream() -> None:
    """Scales of more than one DMA piece go ahead of the loop only where they fit the weights'
    share of the cluster's SRAM (the target's) beside the loop's weight tiles, and where the
    loop streams its weights (decode: blocks of one row); else they load a block at a time with
    their expert (an SRAM that holds the weights but not the scales too; blocks of 64 rows,
    whose contractions outlast their loads). The reference's bits every way. MXFP4 Qwen3 at
    small dims on machines whose DMA pieces are 4 KB: its gathers of 16 rows of 4 KB are 64 KB."""
    from target.machine import default_machine

    source = (Path(__file__).parent.parent / "examples" / "qwen3_moe_fp8.moe").read_text()
    source = source.replace("f8e4m3[E", "f4e2m1[E").replace("f32[E", "e8m0[E")
    roomy = replace(default_machine(), name="small-pieces", dma_split_bytes=4096)
    small = replace(roomy, name="small-sram", slices=32, sram_bytes_per_slice=32768)  # 1 MB a cluster

    def scale_loads(machine: object, tokens: int, block: int) -> tuple[int, int]:
        program = tcpc.compile_source(source, dims=dict(T=tokens, B=block, D=256, F=512, E=4, K=2, **MXFP4_QWEN3),
                                      machine=machine)
        full = ",".join(FULL_PIPELINE)
        module = program.lower(full)
        ahead = [op for op in module.walk() if op.name == "tcp.dma_gather" and "scale" in op.source.name_hint]
        inside = [op for op in module.walk() if op.name == "tile.load_expert" and "scale" in op.source.name_hint
                  and "_guessed" not in (op.result.name_hint or "")]  # (T = 8: 4 pairs per expert, guessed too)
        assert_same_bits(program.run(seed=block, pipeline=full).outputs, program.run(seed=block).outputs)
        return len(ahead), len(inside)

    # 3 x 64 KB beside two experts' 192 KB of weights: in 64 MB (each cluster's three gathers),
    # not in 512 KB; at 2 x 64 x 8 / 4.25 FLOPs per weight byte (> 88) not ahead either.
    assert scale_loads(roomy, 8, 1) == (2 * 3, 0)
    assert scale_loads(small, 8, 1) == (0, 2 * 3)
    assert scale_loads(roomy, 64, 64) == (0, 2 * 3)


@pytest.mark.parametrize("mx", [False, True], ids=["fp8", "mxfp4"])
def test_each_cluster_gathers_its_own_block_scales(mx: bool) -> None:
    """split-clusters gathers the block scales made ahead of the loop once per cluster, by the
    cluster's masked expert ids (rows of the other cluster's blocks left zero), instead of
    copying cluster 0's gather: the layer keeps the reference's bits at decode, where a block
    per expert is spread over both clusters, two tokens and three. (One token, in blocks of one
    row, keeps its loop on cluster 0, its results in SRAM: `test_one_tokens_results_stay_in_sram`.)"""
    source = (Path(__file__).parent.parent / "examples" / "qwen3_moe_fp8.moe").read_text()
    if mx:
        source = source.replace("f8e4m3[E", "f4e2m1[E").replace("f32[E", "e8m0[E")
    for tokens in (2, 3):
        dims = {"T": tokens, "B": 1, **(dict(QK=32, QN=1, QG=32) if mx else {})}
        program = tcpc.compile_source(source, dims=dims)
        full = ",".join(FULL_PIPELINE)
        module = program.lower(full)
        gathers = [op for op in module.walk() if op.name == "tcp.dma_gather" and "scale" in op.source.name_hint]
        assert sorted(cluster_of(op) for op in gathers) == [0, 0, 0, 1, 1, 1]
        assert all(op.indices.name_hint in ("expert_ids_cluster0", "expert_ids_cluster1") for op in gathers)
        assert_same_bits(program.run(seed=tokens, pipeline=full).outputs, program.run(seed=tokens).outputs)


def test_one_tokens_first_weight_loads_do_not_queue_behind_the_block_scales() -> None:
    """With block scales gathered ahead of the loop (Qwen3-30B-A3B's MXFP4 at T = 1), one token's
    loop runs on cluster 0 (its results in SRAM), so the scales are gathered once, three
    commands, and its first weight loads take the engines they leave: the first load starts
    before the gathers end (behind two clusters' six gathers it started at 4,013 cycles; with
    each cluster's first loads issued before its gathers, 2,993; now with the expert ids), and
    each block's expert is fetched once: the last block's matrices after its first in two K
    pieces each (`test_one_tokens_last_block_loads_its_weights_in_pieces`: 19,206 -> 18,552
    cycles)."""
    source = (Path(__file__).parent.parent / "examples" / "qwen3_moe_fp8.moe").read_text()
    source = source.replace("f8e4m3[E", "f4e2m1[E").replace("f32[E", "e8m0[E")
    dims = dict(T=1, D=2048, F=768, E=128, K=8, B=1, QK=32, QN=1, QG=32)
    program = tcpc.compile_source(source, dims=dims)
    module = program.lower("pin-routing," + ",".join(FULL_PIPELINE))
    report = simulate_cost_only(module, program.function().sym_name.data, routing="balanced").report
    loads = [o for o in report.ops if o.name == "tile.load_expert" and o.hbm_bytes]
    scales = [o for o in report.ops if o.name == "tcp.dma_gather" and o.phase == "experts"]
    routing = max(o.end for o in report.ops if o.label.startswith("%expert_ids = "))
    assert len(scales) == 3 and min(o.start for o in loads) < min(o.end for o in scales)
    assert min(o.start for o in loads) == routing
    assert len(loads) == 7 * 3 + 1 + 2 * 2  # each block's expert fetched once, the last one's in pieces
    assert report.total_cycles < 19_000


MXFP4_QWEN3 = dict(QK=32, QN=1, QG=32)
"""Qwen3's fp8 example with MXFP4 weights (f4e2m1, e8m0 scales per 32 along K), as
benchmarks/precisions.py compiles it."""


def test_one_tokens_last_block_loads_its_weights_in_pieces() -> None:
    """Decode in blocks of one row (T = 1, B = 1, results in SRAM): the last block runs as a loop
    of its own whose weights after its first, each one DMA command on one engine, load in two
    pieces along K (at multiples of 512: the contraction grid and MXFP4's blocks of 32), each
    piece's contraction continuing the previous one's f32 sum; the other blocks load whole
    matrices. The reference's bits, with the activations
    quantized in the loop or once per token before it (`quantize=tokens`: the lhs and its scales
    are then windows of values made before the loop)."""
    source = (Path(__file__).parent.parent / "examples" / "qwen3_moe_fp8.moe").read_text()
    source = source.replace("f8e4m3[E", "f4e2m1[E").replace("f32[E", "e8m0[E")
    program = tcpc.compile_source(source, dims=dict(T=1, B=1, D=1024, F=768, E=2, K=2, **MXFP4_QWEN3))
    full = ",".join(FULL_PIPELINE)
    tokens = full.replace("lower-dispatch", "lower-dispatch{quantize=tokens}")

    def expert_loops(pipeline: str) -> list[scf.ForOp]:
        return [op for op in program.lower(pipeline).walk() if isinstance(op, scf.ForOp)
                and any(inner.name == "tile.load_expert" for inner in op.body.walk())]

    loops = expert_loops(full)
    assert [(constant_index(loop.lb), constant_index(loop.ub)) for loop in loops] == [(0, 1), (1, 2)]
    assert len(expert_loops(tokens)) == 2

    def loads(loop: scf.ForOp) -> list[tuple[int, tuple[int, ...]]]:
        """Each weight load's rows (K) and where they start."""
        return [(shape_of(op.result.type)[1], op.window_offsets()) for op in loop.body.walk()
                if op.name == "tile.load_expert"]

    assert loads(loops[0]) == [(1024, (0, 0)), (1024, (0, 0)), (768, (0, 0))]
    assert loads(loops[1]) == [(1024, (0, 0)), (512, (0, 0)), (512, (512, 0)), (512, (0, 0)), (256, (512, 0))]
    assert len([op for op in loops[1].body.walk() if op.name == "tcp.scaled_contract" and op.acc is not None]) == 2
    reference = program.run(seed=1).outputs
    assert_same_bits(program.run(seed=1, pipeline=full).outputs, reference)
    assert_same_bits(program.run(seed=1, pipeline=tokens).outputs, reference)


def test_a_weight_one_command_would_leave_an_engine_idle_for_loads_in_pieces() -> None:
    """tp's halved F (Qwen3-30B-A3B on ep=2,tp=2: F = 384 a chip, one F tile) makes the gate and
    up matrices [2048, 384] bf16, 1.5 MB: one DMA command is a 1 MB and a 0.5 MB part, holding two
    engines for the 1 MB part's time. They load as two K pieces of 1,024 rows (0.75 MB, one
    engine each), each reused by the expert's next block as a whole weight is, each piece's
    contraction continuing the previous one's f32 sum. The down matrix [384, 2048]'s K is under
    one grain (512): it loads as two N pieces of 1,024 columns at the grid's multiples, each
    contraction making its columns of the block's f32 result (stored into their window of an
    SRAM buffer). The reference's bits. (At E = 64, T = 16, B = 2 the stream went from 1,049
    to 1,240 B/cycle, 295,877 -> 251,421 cycles, with the K pieces; Qwen3-30B-A3B ep=2,tp=2 at
    16 tokens a chip, B = 2: 289.3 -> 266.0 us with the N pieces.)"""
    program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / "qwen3_moe.moe",
                                dims=dict(T=8, B=4, D=2048, F=384, E=4, K=2))
    full = ",".join(FULL_PIPELINE)
    module = program.lower(full)
    loads = [(shape_of(op.result.type)[1:], op.window_offsets(), op.prev_ids is not None)
             for op in module.walk() if op.name == "tile.load_expert"]
    piece = [((1024, 384), (0, 0), True), ((1024, 384), (1024, 0), True)]
    columns = [((384, 1024), (0, 0), True), ((384, 1024), (0, 1024), True)]
    assert loads == 2 * [*piece, *piece, *columns]  # two clusters' loops
    windows = [op.window_offsets() for op in module.walk() if op.name == "tile.store" and op.offsets is not None]
    assert windows == 2 * [(0, 0), (0, 1024)]
    assert_same_bits(program.run(seed=1, pipeline=full).outputs, program.run(seed=1).outputs)


def test_the_expert_loop_starts_from_the_dispatch() -> None:
    """A block's weight loads wait for the blocks' row indices, as its row gather does: the
    loop's commands start once the dispatch's are done, whatever those left running, so its
    schedule does not depend on how they fell (issue #12's T sweep: with the first loads issued
    as soon as the expert ids were known, they shared the engines with the dispatch's scatters
    in an order that changed with T, and T = 288 took 7 cycles less than T = 280). One token's
    dispatch (decode, T = 1: one scatter of K rows, whatever the layer) is the exception: its
    loads start as soon as the expert ids are known (Qwen3-30B-A3B: 60,853 -> 60,376 cycles)."""
    qwen3 = {"D": 2048, "F": 768, "E": 128, "K": 8, "B": 1}
    report = cost_only("qwen3_moe.moe", {"T": 2, **qwen3})
    block_tokens = next(o for o in report.ops if o.label.startswith("%block_tokens = "))
    loads = [o for o in report.ops if o.name == "tile.load_expert"]
    assert loads and min(o.start for o in loads) >= block_tokens.end
    report = cost_only("qwen3_moe.moe", {"T": 1, **qwen3})  # no row index at all (blocks of one row)
    routing = max(o.end for o in report.ops if o.phase == "routing" and o.label.startswith("%expert_ids = "))
    loads = [o for o in report.ops if o.name == "tile.load_expert"]
    assert loads and min(o.start for o in loads) < routing + 100
    program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / "qwen3_moe.moe")
    module = program.lower(program.full_pipeline())
    row_indices = {op.indices.owner.source for op in module.walk() if op.name == "tile.gather"}  # a cluster's
    loads = [op for op in module.walk() if op.name == "tile.load_expert"]
    assert loads and all(set(load.after) & row_indices for load in loads)


def test_one_tokens_blocks_read_its_row_where_it_is() -> None:
    """Decode in blocks of one row (T = 1, B = 1): every block that runs holds the token's row,
    so the loop reads it from the router's SRAM copy (a `tcp.view`; the loop stays on cluster 0,
    its results in SRAM) rather than gathering it from HBM per block, and its row -> token index is
    the constant 0 (no dispatch scatter), with the same bits. Where the
    weights stream (F tiles fetched per block) the row gather stays: there the loads span every
    engine back to back, and without the gathers they start in lockstep, every start-up leaving
    HBM idle (Mixtral-8x7B T = 1: 507,447 -> 510,309 cycles)."""
    path = Path(__file__).parent.parent / "examples" / "qwen3_moe.moe"
    program = tcpc.compile_file(path, dims={"T": 1, "B": 1})
    module = program.lower(",".join(FULL_PIPELINE))
    assert not [op for op in module.walk() if op.name == "tile.gather"]
    # nor a row -> token index: the dispatch's scatter of the token's marks is gone with its readers
    assert not [op for op in module.walk() if op.name == "tcp.dma_scatter" or op.name == "tile.copy"
                and op.input.name_hint == "block_tokens"]
    rows = [op for op in module.walk() if op.name == "tcp.view" and op.result.name_hint == "xb_tile"]
    assert [op.input.owner.name for op in rows] == ["tcp.load"]  # the router's load (the loop on cluster 0)
    assert_same_bits(program.run(seed=4, pipeline=",".join(FULL_PIPELINE)).outputs, program.run(seed=4).outputs)
    wide = tcpc.compile_file(path, dims={"T": 1, "B": 1, "D": 16, "F": 1100})
    streamed = wide.lower(LOWERED + ",schedule-experts{sram_bytes=100000}")
    assert [op for op in streamed.walk() if op.name == "tile.gather"]


def test_one_tokens_results_stay_in_sram() -> None:
    """Decode in blocks of one row (T = 1, B = 1): each block's result is committed into an SRAM
    buffer (no store to HBM), the loop stays on cluster 0, where the combine reads it, and the
    combine picks its K rows on the vector engine (`ve.filter`, no DMA gather): after the last
    weight byte only the last tile's contraction, the rows' pick and weighted sum and the
    output's store remain (Qwen3-30B-A3B bf16: 59,308 -> 58,221 cycles, the store and gather of
    the last block's result, 1,144 cycles, off the critical path; the combine's work that does
    not wait for the rows is issued before the loop, 58,095 -> 58,058). Same bits; more tokens
    keep the HBM buffer."""
    path = Path(__file__).parent.parent / "examples" / "qwen3_moe.moe"
    program = tcpc.compile_file(path, dims={"T": 1, "B": 1})
    module = program.lower(",".join(FULL_PIPELINE))

    def result_buffers(module) -> list[str]:  # type: ignore[no-untyped-def]
        return [op.space.data for op in module.walk() if op.name == "tile.buffer" and op.result.name_hint == "y_blocked_buffer"]

    assert result_buffers(module) == ["sram"]
    assert all(cluster_of(op) == 0 for op in module.walk())
    combine = [op.name for op in module.walk() if phase_of(op) == "combine"]
    assert "ve.filter" in combine and "tcp.dma_gather" not in combine
    assert_same_bits(program.run(seed=2, pipeline=",".join(FULL_PIPELINE)).outputs, program.run(seed=2).outputs)
    report = cost_only("qwen3_moe.moe", {"T": 1, "D": 2048, "F": 768, "E": 128, "K": 8, "B": 1})
    last_byte = max(o.end for o in report.ops if o.name == "tile.load_expert")
    after = [o.name for o in report.ops if o.engine == "dma" and o.end > last_byte]
    assert after == ["tcp.store"]  # the layer's output
    vector = {o.name for o in report.ops if o.phase == "combine" and o.engine == "tensor" and o.start >= last_byte}
    assert vector == {"ve.widen", "ve.filter", "ve.chain"}  # the rows' pick, then the weighted sum
    assert not [o for o in report.ops if o.name == "tile.store" and o.engine == "dma"]
    assert result_buffers(tcpc.compile_file(path, dims={"T": 2, "B": 1}).lower(",".join(FULL_PIPELINE))) == ["hbm"]
    # Weights the vector engine decodes (fp4 groups) keep the HBM buffer and both clusters:
    # on one cluster's vector engine Qwen3-30B-A3B's T = 1 took 42.0 -> 74.2 us.
    groups = tcpc.compile_file(path.with_name("qwen3_moe_fp4_groups.moe"), dims={"T": 1, "B": 1})
    decoded = groups.lower(",".join(FULL_PIPELINE))
    assert result_buffers(decoded) == ["hbm"]
    assert {cluster_of(op) for op in decoded.walk() if op.name == "tcp.contract"} == {0, 1}
    # Biases the contraction reads through a view (gpt-oss) are contracted as loaded too:
    # gpt-oss-120b's T = 1 keeps its SRAM results (fp8 77.2 -> 76.7 us, MXFP4 44.2 -> 42.9).
    biased = tcpc.compile_file(path.with_name("gpt_oss_mxfp4.moe"), dims={"T": 1, "B": 1})
    assert any(op.name == "tcp.view" for op in biased.lower(",".join(FULL_PIPELINE)).walk())
    assert result_buffers(biased.lower(",".join(FULL_PIPELINE))) == ["sram"]


def hbm_reads_by_compute(module) -> list[str]:  # type: ignore[no-untyped-def]
    """Operands in HBM that a contraction or vector-engine op reads: those engines read SRAM,
    and the memory plan gives HBM values no buffer, so such a read would be free."""
    from runtime_sim.perf.cost_model import in_hbm

    return [f"{op.name} reads %{v.name_hint}" for op in module.walk()
            if op.dialect_name() == "ve" or op.name in ("tcp.contract", "tcp.scaled_contract")
            for v in op.operands if in_hbm(v)]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_no_compute_engine_reads_hbm(path: Path) -> None:
    """Every value the contraction and vector engines read is in SRAM after the full pipeline:
    arguments are loaded (load-arguments), and an expert loop's results stored in HBM are
    loaded once after the loop when an engine reads them (a shared expert's rows added to the
    routed ones: DeepSeek-V3, Llama-4), not read from HBM for free."""
    program = tcpc.compile_file(path)
    assert hbm_reads_by_compute(program.lower(program.full_pipeline())) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_layers_results_end_in_hbm(path: Path) -> None:
    """The layer's output is the next layer's input: after the full pipeline the function
    returns values in HBM, each written by a DMA store (a token loop's tiles, or one tcp.store
    of a result made whole), never left in SRAM (they were, while the chip limit counted them)."""
    from runtime_sim.perf.cost_model import in_hbm

    program = tcpc.compile_file(path)
    returned = program.lower(program.full_pipeline()).walk()
    outputs = [v for op in returned if op.name == "func.return" for v in op.operands]
    assert outputs and all(in_hbm(v) for v in outputs)


def test_the_output_bytes_are_stored_to_hbm_once() -> None:
    """Qwen3-30B-A3B at T = 4096 (real dims): the combine's loop stores each tile of the
    output to HBM as it is made, overlapped with the next tile's gather, and the stores' HBM
    bytes, T x D x 2 (bf16), are in the report and its roofline."""
    dims = dict(T=4096, D=2048, F=768, E=128, K=8, B=256)
    report = cost_only("qwen3_moe.moe", dims)
    stores = [o for o in report.ops if o.phase == "combine" and o.name in ("tile.store", "tcp.store")]
    assert sum(o.hbm_bytes for o in stores) == 4096 * 2048 * 2 and all(o.engine == "dma" for o in stores)
    gathers = [o for o in report.ops if o.phase == "combine" and o.name == "tcp.dma_gather"]
    assert any(g.start < s.end and s.start < g.end for s in stores for g in gathers)
    assert report.roofline.hbm_bytes >= sum(o.hbm_bytes for o in report.ops if o.name == "tile.load_expert") + 4096 * 2048 * 2


def test_a_combine_gathering_more_than_a_dma_piece_runs_in_a_tile_per_engine() -> None:
    """A combine that fits SRAM whole but gathers more than one DMA piece of rows from HBM (decode,
    Qwen3-30B-A3B at T = 64: 2 MB, two 1 MB pieces on two engines, then one 256 KB store on one)
    runs in a tile per engine (`spread_rows`: 8 tiles of 8 rows), the tiles' gathers side by side
    on all eight and each tile's sum and store behind its own gather: the combine's share of the
    critical path 7,173 -> 3,667 cycles (MXFP4, B = 4, balanced). The reference's bits; at small
    dims on a machine of 4 KB pieces (8 KB gathered at T = 16, two tiles), and whole where it
    gathers one piece or less."""
    from target.machine import default_machine

    path = Path(__file__).parent.parent / "examples" / "qwen3_moe.moe"
    small = replace(default_machine(), name="small-pieces", dma_split_bytes=4096)

    def combine_steps(machine: object, tokens: int) -> list[int]:
        program = tcpc.compile_file(path, dims=dict(T=tokens, D=64, F=64, E=8, K=4, B=4), machine=machine)
        full = ",".join(FULL_PIPELINE)
        module = program.lower(full)
        assert_same_bits(program.run(seed=tokens, pipeline=full).outputs, program.run(seed=tokens).outputs)
        return [constant_index(op.step) for op in module.walk()
                if isinstance(op, scf.ForOp) and any(phase_of(o) == "combine" for o in op.body.walk())]

    assert combine_steps(small, 16) == [8]
    assert combine_steps(default_machine(), 16) == []
    dims = dict(T=64, D=2048, F=768, E=128, K=8, B=4, **MXFP4_QWEN3)
    source = (path.with_name("qwen3_moe_fp8.moe")).read_text().replace("f8e4m3[E", "f4e2m1[E").replace("f32[E", "e8m0[E")
    program = tcpc.compile_source(source, dims=dims)
    module = program.lower("pin-routing," + ",".join(FULL_PIPELINE))
    report = simulate_cost_only(module, program.function().sym_name.data, routing="balanced").report
    gathers = [o for o in report.ops if o.phase == "combine" and o.name == "tcp.dma_gather"]
    assert len(gathers) == 8 and len({o.unit for o in gathers}) == 8
    assert next(p.critical_cycles for p in report.phases if p.name == "combine") == 3_667


@pytest.mark.parametrize("example, tokens", [("deepseek_v3", 512), ("qwen3_moe", 300)])
def test_a_router_matmul_in_token_tiles_is_exact(example: str, tokens: int) -> None:
    """With T >= clusters x GRID_M, schedule-tokens takes the router's matmul into the token loop
    (tiles of GRID_M multiples, one per cluster after split-clusters; Qwen3's 300 rows leave a
    44-row remainder): the full pipeline still gives the reference's bits."""
    program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / f"{example}.moe", dims={"T": tokens, "B": 4})
    scheduled = program.lower(",".join(FULL_PIPELINE))
    rows = sorted(op.result.type.get_shape()[0] for op in scheduled.walk()
                  if op.name == "tcp.contract" and op.attributes["tcpc.phase"].data == "router")
    assert sum(rows) == tokens and max(rows) % 128 == 0 and len(rows) >= 2, rows  # in tiles, whole chunks
    assert_same_bits(program.run(seed=5, pipeline=",".join(FULL_PIPELINE)).outputs, program.run(seed=5).outputs)


def test_a_router_matmul_shared_by_the_clusters_below_two_grid_tiles_is_exact() -> None:
    """Under 129 tokens an f32 router's matmul joins the token loop where the cycles the second
    cluster's tile saves outweigh what it adds (`sharing_pays`): DeepSeek-V3 at D = 2048, E = 64,
    T = 128 with f32 tokens that are not a widened bf16 (f32(x) * 1.0: nine bf16 piece pairs;
    the mapping level: 4,728 cycles whole, 2,364 a 64-row tile, against 2 x 1,012 for the router
    weight's copy and 3 x 500 start-ups), its two 64-row tiles then one per cluster. Cut off the
    contraction grid's 128 rows, a tile's rows keep their bits (numerics.contract): the IR before
    and after the pass, and the full pipeline, give the same bits. The example's own router, on
    the widened tokens' one piece (three pairs), saves too little and stays whole, as does its
    toy router (D = 64)."""
    from passes.schedule.schedule_tokens import sharing_pays

    examples = Path(__file__).parent.parent / "examples"
    dims = {"T": 128, "D": 2048, "E": 64, "B": 4}
    source = (examples / "deepseek_v3.moe").read_text()
    program = compile_source(source.replace("f32(x) @ router", "(f32(x) * 1.0) @ router"), dims=dims)
    before = f"{LOWERED},schedule-experts"
    after = before + ",schedule-tokens"

    def router_matmuls(module: ModuleOp) -> list[Operation]:
        return [op for op in function_in(module, "deepseek_v3").body.block.walk()
                if op.name == "tcp.contract" and phase_of(op) == "router"]

    widened = router_matmuls(tcpc.compile_file(examples / "deepseek_v3.moe", dims=dims).lower(after))
    assert [shape_of(op.result.type) for op in widened] == [(128, 64)]
    matmuls = router_matmuls(program.lower(after))
    assert [shape_of(op.result.type) for op in matmuls] == [(64, 64)]
    assert isinstance(matmuls[0].parent_op(), scf.ForOp)
    assert sharing_pays(matmuls, 128, 128, 2, 3) and not sharing_pays(matmuls, 128, 128, 1, 3)
    scheduled = program.lower(",".join(FULL_PIPELINE))
    clusters = sorted(cluster_of(op) for op in scheduled.walk()
                      if op.name == "tcp.contract" and phase_of(op) == "router")
    assert clusters == [0, 1]
    want = program.run(seed=6, pipeline=before).outputs
    assert_same_bits(program.run(seed=6, pipeline=after).outputs, want)
    assert_same_bits(program.run(seed=6, pipeline=",".join(FULL_PIPELINE)).outputs, want)
    toy = tcpc.compile_file(examples / "deepseek_v3.moe", dims={"T": 128, "B": 4}).lower(after)
    assert not any(isinstance(op.parent_op(), scf.ForOp) for op in toy.walk()
                   if op.name == "tcp.contract" and phase_of(op) == "router")


def test_a_router_matmul_cheaper_in_its_own_tiles_gets_its_own_loop() -> None:
    """Where the top-k's ranking keeps the router phase's tiles small, the router's matmul (and
    the widening it reads through) runs in a loop of its own, in the larger tiles its own ops
    allow, when its mapping takes fewer cycles so: DeepSeek-V3's f32 router at D = 2048, T =
    1024 in 4 MB tiles, 256 rows a tile (before: with the ranking, 128; the full pipeline's
    router phase, cost-only, balanced: 25,072 -> 20,480 cycles). Its tokens are loaded a tile
    at a time from HBM, though the whole SRAM copy stays for the shared expert. The IR before
    schedule-tokens and after give the same bits."""
    from passes.schedule.schedule_tokens import contraction_cycles

    program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / "deepseek_v3.moe",
                                dims={"T": 1024, "D": 2048, "B": 64})
    before = f"{LOWERED},schedule-experts"
    after = before + ",schedule-tokens{tile_bytes=4194304}"
    scheduled = program.lower(after)
    router_loops = [op for op in function_in(scheduled, "deepseek_v3").body.block.ops
                    if isinstance(op, scf.ForOp) and phase_of(op) == "router"]
    assert len(router_loops) == 2
    head, rest = router_loops
    matmuls = [op for op in head.body.walk() if op.name == "tcp.contract"]
    assert [shape_of(op.result.type) for op in matmuls] == [(256, 16)]
    assert [op.name for op in head.body.walk()][0] == "tile.load"
    assert not any(op.name == "tcp.contract" for op in rest.body.walk())
    assert constant_index(rest.step) == 176
    assert contraction_cycles(matmuls, 256, 1024, 2) < contraction_cycles(matmuls, 128, 1024, 2)
    assert_same_bits(program.run(seed=4, pipeline=after).outputs, program.run(seed=4, pipeline=before).outputs)


def test_a_router_head_whose_first_tile_load_outweighs_its_saving_stays_in_the_phase_loop() -> None:
    """The router's own loop pays its first tile's load before its first contraction: Llama-4-
    Scout's bf16 router at T = 4096 (D = 5120, E = 16) would take 3,200-row tiles there (a 33 MB
    load no contraction hides) for fewer estimated contraction cycles than the phase's 384-row
    tiles; with the load counted it keeps one loop (the real dims' router phase: 59,584 cycles
    in two loops, 30,744 in one)."""
    from passes.schedule.schedule_tokens import contraction_cycles, first_load_cycles

    program = tcpc.compile_file(Path(__file__).parent.parent / "examples" / "llama4.moe",
                                dims={"T": 4096, "D": 5120, "F": 256, "FS": 256, "E": 16, "K": 1, "B": 256})
    before = f"{LOWERED},schedule-experts"
    scheduled = program.lower(before + ",schedule-tokens")
    router_loops = [op for op in function_in(scheduled, program.function().sym_name.data).body.block.ops
                    if isinstance(op, scf.ForOp) and phase_of(op) == "router"]
    assert [constant_index(op.step) for op in router_loops] == [384]
    matmuls = [op for op in program.lower(before).walk() if op.name == "tcp.contract" and phase_of(op) == "router"]
    assert len(matmuls) == 1
    # the contraction alone would have taken the head's tiles (3,200 rows, and the rest)
    assert contraction_cycles(matmuls, 3200, 4096, 2) < contraction_cycles(matmuls, 384, 4096, 2)
    assert (contraction_cycles(matmuls, 3200, 4096, 2) + first_load_cycles(matmuls, 3200, 4096)
            > contraction_cycles(matmuls, 384, 4096, 2) + first_load_cycles(matmuls, 384, 4096))


def test_resident_tile_is_the_narrowest_of_equals() -> None:
    """Resident F tiles take the width whose loads hold the DMA engines least, the narrowest of
    equals (its first tile contracts while the next arrive), one token's too: with its results
    in SRAM only the last tile's contraction and the combine follow the last weight byte
    (Qwen3-30B-A3B's bf16 F = 768 at T = 1 as 512 and 256: 58,221 -> 58,095 cycles against
    whole); its fp8 tiles (1 MB and 0.5 MB hold the engines less than 1.5 MB whole) likewise."""
    path = Path(__file__).parent.parent / "examples"
    qwen3 = {"D": 2048, "F": 768, "E": 16, "K": 8, "B": 1}

    def widths(stem: str, tokens: int) -> list[int]:
        module = tcpc.compile_file(path / f"{stem}.moe", dims={"T": tokens, **qwen3}).lower(LOWERED + ",schedule-experts")
        return [shape_of(op.result.type)[2] for op in module.walk()
                if op.name == "tile.load_expert" and op.source.name_hint == "w_gate"]

    assert widths("qwen3_moe", 1) == [512, 256]
    assert widths("qwen3_moe", 2) == [512, 256]
    assert widths("qwen3_moe_fp8", 1) == [512, 256]
