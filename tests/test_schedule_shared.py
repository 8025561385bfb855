"""A shared expert on the schedule level (passes/schedule/schedule_shared.py, then schedule-experts and
split-clusters): translation validation against the lowered IR and the reference, and what its
loop costs at Llama-4-Scout's real dims."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tcpc
from passes.schedule.schedule_shared import choose_rows
from runtime_sim.perf.cost_only import simulate_cost_only
from tcpc.pipelines import FULL_PIPELINE, LOWERED_PIPELINE
from tests.test_schedule import F_TILE_MODES, assert_same_bits

EXAMPLES = Path(__file__).parent.parent / "examples"
LOWERED = ",".join(LOWERED_PIPELINE)
SHARED_EXAMPLES = ["llama4", "deepseek_v3"]


def test_the_row_block_divides_t_on_the_contraction_grid() -> None:
    assert choose_rows(1) == 1 and choose_rows(64) == 64 and choose_rows(200) == 200  # one block
    assert choose_rows(256) == 128 and choose_rows(2048) == 512 and choose_rows(4096) == 512
    assert choose_rows(384) == 128  # three blocks: 384 has no even split on the grid
    assert choose_rows(1536) == 384  # four blocks rather than three of 512
    assert choose_rows(2048, forced=256) == 256 and choose_rows(2048, forced=300) == 512


@pytest.mark.parametrize("example", SHARED_EXAMPLES)
def test_each_pass_keeps_the_bits_with_row_blocks_and_streamed_f_tiles(example: str) -> None:
    """T = 256 in 2 row blocks, FS = 1100 in streamed F tiles of 512, 512 and 76: the IR before
    and after each pass, and after the whole pipeline, gives the reference's bits."""
    program = tcpc.compile_file(EXAMPLES / f"{example}.moe", dims={"T": 256, "D": 16, "FS": 1100})
    reference = program.run(seed=2).outputs
    lowered = program.run(seed=2, pipeline=LOWERED).outputs
    shared = program.run(seed=2, pipeline=LOWERED + ",schedule-shared").outputs
    experts = program.run(seed=2, pipeline=LOWERED + f",schedule-shared,schedule-experts{F_TILE_MODES['streamed']}")
    split = program.run(seed=2, pipeline=LOWERED + f",schedule-shared,schedule-experts{F_TILE_MODES['streamed']},"
                        "split-clusters").outputs
    scheduled = program.run(seed=2, pipeline=",".join(FULL_PIPELINE)).outputs
    assert_same_bits(lowered, reference)
    for got in (shared, experts.outputs, split, scheduled):
        assert_same_bits(got, lowered)
    module = program.lower(LOWERED + f",schedule-shared,schedule-experts{F_TILE_MODES['streamed']}")
    starts = sorted({max(op.window_offsets()) for op in module.walk() if op.name == "tile.load_expert"
                     and op.offsets and op.attributes["tcpc.phase"].data == "shared"})
    assert starts == [0, 512, 1024]  # the shared expert's weights in three F tiles


@settings(max_examples=6, deadline=None)
@given(tokens=st.sampled_from([1, 5, 128, 256, 384, 512]), fs=st.sampled_from([8, 600, 1100]),
       f_mode=st.sampled_from(sorted(F_TILE_MODES)), example=st.sampled_from(SHARED_EXAMPLES),
       clusters=st.sampled_from([1, 2, 4]), seed=st.integers(0, 3))
def test_shared_expert_tiles_are_exact(tokens: int, fs: int, f_mode: str, example: str, clusters: int,
                                       seed: int) -> None:
    """One row block or several (an odd number: 384 = 3 x 128, split by owner masks), FS whole
    or not a multiple of the F tile, on 1, 2 or 4 clusters, spread through the routed loop by
    interleave-shared where there are several: the reference's bits."""
    dims = {"T": tokens, "D": 16, "FS": fs, "B": min(4, tokens)}
    program = tcpc.compile_file(EXAMPLES / f"{example}.moe", dims=dims)
    pipeline = (f"{LOWERED},schedule-shared,schedule-experts{F_TILE_MODES[f_mode]},schedule-tokens,"
                f"split-clusters{{clusters={clusters}}},interleave-shared,fuse-ve-chains")
    assert_same_bits(program.run(seed=seed, pipeline=pipeline).outputs, program.run(seed=seed).outputs)


LLAMA4_SCOUT = dict(D=5120, F=8192, FS=8192, E=16)


def cost_only(dims: dict[str, int]):
    program = tcpc.compile_file(EXAMPLES / "llama4.moe", dims=dims)
    module = program.lower("pin-routing," + ",".join(FULL_PIPELINE))
    return simulate_cost_only(module, program.function().sym_name.data, routing="balanced").report


def test_llama4_scout_decode_needs_no_spill_or_stream_and_loads_the_shared_expert_during_the_routing() -> None:
    """Llama-4-Scout at T = 1: 252 MB of shared weights (and as much for the routed expert)
    stream in F tiles with no spill or stream; the shared expert runs on cluster 1 and its
    first weights are on their way before the routing ends, so the layer takes little more
    than its weight bytes at HBM bandwidth: its 10 MB weight tiles load over all eight DMA
    engines one after another, each paying its 500-cycle start-up before its 6,991 cycles of
    data (7%)."""
    report = cost_only(dict(LLAMA4_SCOUT, T=1, B=1))
    assert not report.spills and not report.streams
    assert report.peak_sram_bytes <= report.machine.sram_bytes
    shared = [o for o in report.ops if o.phase == "shared"]
    fetched = [o for o in shared if o.name == "tile.load_expert" and o.hbm_bytes > 0]
    assert sum(o.hbm_bytes for o in fetched) == 3 * 5120 * 8192 * 2  # the shared weights, once
    assert {o.unit for o in shared if o.engine == "tensor"} == {1}
    routing_end = max(o.end for o in report.ops if o.phase == "routing")
    assert min(o.start for o in fetched) < routing_end
    assert report.total_cycles < 1.08 * report.roofline.byte_cycles


def test_llama4_scout_prefill_splits_the_shared_expert_over_both_clusters() -> None:
    """T = 2048 in 4 row blocks of 512: both clusters contract shared blocks, half the work
    each, no spill; interleave-shared spreads them through the routed loop (B = 128, which waits
    for HBM)."""
    report = cost_only(dict(LLAMA4_SCOUT, T=2048, B=128))
    assert not report.spills and not report.streams
    contracts = [o for o in report.ops if o.phase == "shared" and o.name == "tcp.contract" and o.flops]
    assert sum(o.flops for o in contracts) == 2 * 3 * 2048 * 5120 * 8192
    for unit in (0, 1):
        shared = [o for o in contracts if o.unit == unit]
        routed = [o for o in report.ops if o.phase == "experts" and o.name == "tcp.contract" and o.flops and o.unit == unit]
        assert 2 * sum(o.flops for o in shared) == sum(o.flops for o in contracts)
        first, last = min(o.start for o in routed), max(o.end for o in routed)
        # The routed loop in 16 pieces (16 blocks filled), each after a sixteenth of the shared
        # contractions: most of them run while the routed loop does (84 of 96; none before
        # interleave-shared, which ran them all before it).
        assert sum(first < o.start < last for o in shared) >= len(shared) * 3 // 4


@pytest.mark.parametrize("tokens, clusters", [(384, 2), (256, 4), (512, 2)])
def test_odd_or_few_blocks_split_over_the_clusters_are_exact(tokens: int, clusters: int) -> None:
    """3 row blocks on 2 clusters (owner masks), 2 blocks on 4 clusters, 4 blocks on 2
    (unrolled, interleaved): the lowered IR's bits."""
    program = tcpc.compile_file(EXAMPLES / "llama4.moe", dims={"T": tokens, "D": 16, "FS": 600})
    lowered = program.run(seed=5, pipeline=LOWERED).outputs
    split = program.run(seed=5, pipeline=LOWERED + f",schedule-shared,schedule-experts,split-clusters{{clusters={clusters}}}")
    assert_same_bits(split.outputs, lowered)


def test_resident_shared_weights_are_fetched_once_per_cluster() -> None:
    """Small weights stay in SRAM (F whole): 4 row blocks of 128, 2 per cluster, and each
    cluster fetches each of the three weights once, its second block reusing them."""
    program = tcpc.compile_file(EXAMPLES / "llama4.moe", dims={"T": 512, "D": 64, "FS": 256, "B": 16})
    module = program.lower(f"pin-routing,{LOWERED},schedule-shared{{rows=128}},schedule-experts,schedule-tokens,"
                           "split-clusters,fuse-ve-chains")
    report = simulate_cost_only(module, program.function().sym_name.data, routing="balanced").report
    loads = [o for o in report.ops if o.phase == "shared" and o.name == "tile.load_expert"]
    fetched = [o for o in loads if o.hbm_bytes > 0]
    assert len(loads) == 3 * 4 and len(fetched) == 3 * 2
    assert sum(o.hbm_bytes for o in fetched) == 2 * 3 * 64 * 256 * 2


def test_a_shared_expert_whose_quantization_the_dispatch_reads_is_rewritten() -> None:
    """With lower-dispatch{quantize=tokens}, DeepSeek-V3's shared expert reads the tokens'
    quantization that the dispatch's gathers read too: schedule-shared quantizes each row
    block again inside its loop (the whole quantization stays, for the dispatch), so nothing
    of the shared expert is left whole, and the IR before and after the pass (and after the
    schedule level and split-clusters) gives the same bits."""
    program = tcpc.compile_file(EXAMPLES / "deepseek_v3_fp8.moe",
                                dims={"T": 256, "B": 4, "D": 128, "F": 128, "FS": 640, "E": 8, "K": 2})
    lowered_pipeline = LOWERED.replace("lower-dispatch", "lower-dispatch{quantize=tokens}")
    lowered = program.run(seed=4, pipeline=lowered_pipeline).outputs
    streamed = f",schedule-shared,schedule-experts{F_TILE_MODES['streamed']}"
    for pipeline in (lowered_pipeline + ",schedule-shared", lowered_pipeline + streamed + ",split-clusters"):
        assert_same_bits(program.run(seed=4, pipeline=pipeline).outputs, lowered)
    module = program.lower(lowered_pipeline + ",schedule-shared")
    phases = {op.attributes["tcpc.phase"].data for op in module.walk() if op.name == "tcp.scaled_contract"}
    assert "shared" in phases and "other" not in phases
    assert any(op.name == "tcp.dma_gather" and op.attributes["tcpc.phase"].data == "dispatch"
               and "f8" in str(op.result.type) for op in module.walk())  # the dispatch gathers quantized rows


@pytest.mark.parametrize("tokens", [1, 256])
def test_a_block_scaled_shared_expert_is_rewritten_and_keeps_the_bits(tokens: int) -> None:
    """DeepSeek-V3's fp8 shared expert (x quantized per group of 128, `tcp.scaled_contract` on
    lower-quant's [1, T, K] views): its quantization and contractions become the blocked loop
    of phase `shared` (T = 256: two row blocks; T = 1: one), FS = 640 in streamed F tiles of
    512 and 128 whose down-projection continues the sum; the IR before and after each pass,
    and after the whole pipeline, gives the lowered program's bits."""
    program = tcpc.compile_file(EXAMPLES / "deepseek_v3_fp8.moe",
                                dims={"T": tokens, "B": min(4, tokens), "D": 128, "F": 128, "FS": 640, "E": 8, "K": 2})
    lowered = program.run(seed=3, pipeline=LOWERED).outputs
    streamed = f",schedule-shared,schedule-experts{F_TILE_MODES['streamed']}"
    for pipeline in (LOWERED + ",schedule-shared", LOWERED + streamed + ",split-clusters", ",".join(FULL_PIPELINE)):
        assert_same_bits(program.run(seed=3, pipeline=pipeline).outputs, lowered)
    module = program.lower(LOWERED + streamed)
    shared = [op for op in module.walk() if op.attributes.get("tcpc.phase") is not None
              and op.attributes["tcpc.phase"].data == "shared"]
    assert not [op for op in module.walk() if op.name == "tcp.scaled_contract"
                and op.attributes["tcpc.phase"].data == "other"]  # nothing of it left whole
    assert any(op.name == "tcp.scaled_contract" and op.acc is not None for op in shared)
    assert any(op.name == "scf.for" for op in shared)


def test_a_block_scaled_shared_expert_rounds_its_rows_in_its_loop() -> None:
    """The fp8 shared expert's down-projection gives f32 sums that the program rounds to bf16
    (lower-quant's [T, D] view, then `ve.narrow`): schedule-shared moves that rounding into the
    blocked loop, so the loop stores bf16 rows (half the HBM bytes of the f32 sums, stored and
    loaded back); same bits as before."""
    program = tcpc.compile_file(EXAMPLES / "deepseek_v3_fp8.moe",
                                dims={"T": 256, "B": 4, "D": 128, "F": 128, "FS": 256, "E": 8, "K": 2})
    lowered = program.run(seed=6, pipeline=LOWERED).outputs
    assert_same_bits(program.run(seed=6, pipeline=LOWERED + ",schedule-shared,schedule-experts").outputs, lowered)
    module = program.lower(LOWERED + ",schedule-shared,schedule-experts")
    stores = [op for op in module.walk() if op.name == "tile.store" and op.attributes["tcpc.phase"].data == "shared"]
    assert stores and all("bf16" in str(op.operands[0].type) for op in stores)


def test_the_largest_row_block_is_a_choice_the_driver_leaves_to_the_cost_model_at_prefill() -> None:
    """`most_rows` cuts T = 1280 into 10 blocks of 128 (at most 512 rows: 640 would leave an
    odd count below it) or 2 of 640 (at most 1024), 4096 into 8 of 512 or 4 of 1024; the driver
    asks the cost model only where a shared expert's blocks could differ."""
    assert choose_rows(1280) == 128 and choose_rows(1280, most=1024) == 640
    assert choose_rows(4096, most=1024) == 1024 and choose_rows(1024, most=1024) == 512
    def pipeline(example: str, tokens: int) -> str:
        return tcpc.compile_file(EXAMPLES / f"{example}.moe", dims={"T": tokens, "B": 64}).full_pipeline()

    assert "schedule-shared{most_rows=auto}" in pipeline("llama4", 1280)
    assert "most_rows" not in pipeline("llama4", 1024) and "most_rows" not in pipeline("qwen3_moe", 4096)


@pytest.mark.parametrize(("dims", "chosen"), [({"D": 64, "FS": 256}, "1024"), ({"D": 2048, "FS": 512}, "512")])
def test_the_cost_model_chooses_the_shared_row_block_both_ways(dims: dict[str, int], chosen: str) -> None:
    """Llama-4 at T = 1280 (cost-only, balanced): with small shared weights two blocks of 640
    rows take fewer cycles (fewer blocks and commands: 15,444 -> 14,212 cycles); with D = 2048
    ten blocks of 128 do (the 640-row blocks' [640, 2048] f32 sums and rows hold SRAM the
    routed loop's tiles want: 87,241 against 93,065)."""
    program = tcpc.compile_file(EXAMPLES / "llama4.moe", dims={"T": 1280, "B": 64, **dims})
    spec = program.full_pipeline().replace("strategy=auto", "strategy=rank").replace("order=auto", "order=block")
    _, choices = program.passes(spec, routing="balanced")
    (choice,) = [c for c in choices if c.what == "schedule-shared most_rows"]
    assert choice.chosen == chosen and dict(choice.alternatives)[chosen] < dict(choice.alternatives)[
        next(v for v in ("512", "1024") if v != chosen)]


def test_wider_shared_row_blocks_keep_the_bits() -> None:
    """The same layer with the shared expert in 2 row blocks of 640 (most_rows=1024) or 10 of
    128 (512), run on the same inputs: the same bits, the reference's."""
    program = tcpc.compile_file(EXAMPLES / "deepseek_v3_fp8.moe",
                                dims={"T": 1280, "B": 64, "D": 128, "F": 128, "FS": 256, "E": 8, "K": 2})
    reference = program.run(seed=7).outputs
    for most in ("512", "1024"):
        spec = program.full_pipeline().replace("most_rows=auto", f"most_rows={most}").replace(
            "strategy=auto", "strategy=rank").replace("order=auto", "order=block").replace("quantize=auto", "quantize=tokens")
        assert_same_bits(program.run(seed=7, pipeline=spec).outputs, reference)


def test_a_larger_shared_row_block_whose_buffers_spill_is_not_taken(tmp_path: Path) -> None:
    """On a chip of 5,824 bytes of SRAM a slice (2.84 MB), Llama-4's two 640-row blocks take fewer
    cycles than ten of 128 but their memory plan spills: the schedule level places every buffer
    in SRAM, so the driver keeps the default (tcpc/autotune.py, FITTING_CHOICES). At 5.5 KB a slice
    (the chip this test used first) the larger blocks became the dearer too (17,648 against 17,464
    cycles) once the pinned routing waited for the router's top-k (`tcp.order`)."""
    machine = tmp_path / "small.toml"
    machine.write_text('extends = "rngd"\nname = "small-sram"\n[sram]\n'
                       'bytes_per_slice = { value = 5824, assumption = "test" }\n')
    program = tcpc.compile_file(EXAMPLES / "llama4.moe", dims={"T": 1280, "B": 64, "D": 64, "FS": 256})
    spec = program.full_pipeline().replace("strategy=auto", "strategy=rank").replace("order=auto", "order=block")
    _, choices = program.passes(spec, routing="balanced", machine=machine)
    (choice,) = [c for c in choices if c.what == "schedule-shared most_rows"]
    cycles = dict(choice.alternatives)
    assert cycles["1024"] < cycles["512"] and choice.chosen == "512"
