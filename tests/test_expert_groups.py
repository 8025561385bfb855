"""schedule-experts{order=tile}: the expert loop over groups of blocks
(passes/schedule/_expert_groups.py). Translation validation against the graph-level reference
(a loop order changes only time), the slots of any ids, and what the order saves: each weight
tile crosses HBM once per expert of a group, and a group's contractions take its rows at once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import assert_same_bits
from xdsl.dialects import func, scf
from xdsl.dialects.builtin import ModuleOp, TensorType, i32
from xdsl.ir import Block, Operation, Region, SSAValue

import tcpc
from dialects.annotations import cluster_of, phase_of
from passes.schedule import _expert_groups
from passes.schedule._expert_groups import chunk_rows, slot_tables
from runtime_sim.perf.cost_only import simulate_cost_only
from runtime_sim.perf.report import SimReport
from runtime_sim.semantics.executor import run_function
from tcpc.pipelines import LOWERED_PIPELINE, SCHEDULE_PIPELINE
from tcpc.schedule_summary import contraction_mappings

EXAMPLES = Path(__file__).parent.parent / "examples"
LOWERED = ",".join(LOWERED_PIPELINE)


def scheduled(options: str, clusters: int | None = None) -> str:
    """The full pipeline with schedule-experts' `options` (and split-clusters' clusters)."""
    passes = [f"schedule-experts{{{options}}}" if p == "schedule-experts" else p for p in SCHEDULE_PIPELINE]
    if clusters is not None:
        passes = [f"split-clusters{{clusters={clusters}}}" if p == "split-clusters" else p for p in passes]
    return ",".join([LOWERED, *passes])


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.moe")), ids=lambda p: p.stem)
def test_every_example_is_bit_identical_in_groups(path: Path) -> None:
    """Every example in groups of 3 blocks (G is no multiple of 3: a loop of the blocks left
    over too), through the whole schedule level: the reference's bits. Block-scaled experts
    (fp8, MXFP4) keep block order."""
    program = tcpc.compile_file(path)
    reference = program.run(seed=5).outputs
    assert_same_bits(program.run(seed=5, pipeline=scheduled("order=tile group=3")).outputs, reference)


F_MODES = {"whole": "", "resident": " f_tile=512", "streamed": " sram_bytes=100000"}
"""F whole, F tiles of 512 kept for an expert's next group, F tiles streamed through SRAM."""


@settings(max_examples=12, deadline=None)
@given(tokens=st.integers(1, 48), block=st.sampled_from([1, 2, 4, 8]), experts=st.sampled_from([4, 8]),
       k=st.integers(1, 3), group=st.sampled_from([0, 2, 3, 5]), f=st.sampled_from([8, 600, 1100]),
       f_mode=st.sampled_from(sorted(F_MODES)), clusters=st.sampled_from([1, 2, 4]), seed=st.integers(0, 5),
       family=st.sampled_from(["qwen3_moe", "gpt_oss"]))
def test_groups_are_exact(tokens: int, block: int, experts: int, k: int, group: int, f: int, f_mode: str,
                          clusters: int, seed: int, family: str) -> None:
    """Any T, B, E, K, group (0: as many as fit), F tiling and clusters: the reference's bits
    (gpt-oss: biases on every projection)."""
    dims = {"T": tokens, "B": min(block, tokens), "E": experts, "K": min(k, experts), "D": 16, "F": f}
    program = tcpc.compile_file(EXAMPLES / f"{family}.moe", dims=dims)
    pipeline = scheduled(f"order=tile group={group}{F_MODES[f_mode]}", clusters)
    assert_same_bits(program.run(seed=seed, pipeline=pipeline).outputs, program.run(seed=seed).outputs)


def test_blocks_of_256_rows_are_exact_in_chunks_of_128() -> None:
    """Blocks of 256 rows contract as two chunks of the grid's 128 rows, a chunk of padding rows
    skipped, with the bits of the block's own contraction."""
    assert chunk_rows(256) == 128 and chunk_rows(64) == 64 and chunk_rows(200) == 200
    program = tcpc.compile_file(EXAMPLES / "mixtral.moe", dims={"T": 300, "D": 16, "F": 1100, "E": 4, "B": 256})
    for options in ("order=tile group=2", "order=tile group=1 sram_bytes=100000"):
        assert_same_bits(program.run(seed=2, pipeline=scheduled(options)).outputs, program.run(seed=2).outputs)


def slot_reference(ids: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Each group's distinct experts in order of first appearance (-1 after), and for each the
    ids of its blocks (-1 elsewhere)."""
    experts = np.full((ids.shape[0], slots), -1, np.int32)
    guards = np.full((ids.shape[0], slots, ids.shape[1]), -1, np.int32)
    for g, row in enumerate(ids):
        firsts = list(dict.fromkeys(int(e) for e in row if e >= 0))
        experts[g, :len(firsts)] = firsts
        for s, e in enumerate(firsts):
            guards[g, s] = np.where(row == e, row, -1)
    return experts, guards


@settings(max_examples=20, deadline=None)
@given(groups=st.integers(1, 4), group=st.integers(1, 6), experts=st.integers(1, 5), seed=st.integers(0, 1000))
def test_slots_are_each_groups_distinct_experts_whatever_the_layout(groups: int, group: int, experts: int,
                                                                     seed: int) -> None:
    """The slot tables for ids in any order (an expert's blocks need not be adjacent), with
    unused blocks anywhere: every distinct expert gets a slot, whose guards name its blocks."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(-1, experts, (groups, group)).astype(np.int32)
    slots = min(group, experts)
    block = Block(arg_types=[TensorType(i32, [groups, group]), TensorType(i32, [groups * group, 1])])

    def add(op: Operation, name: str | None = None) -> SSAValue:
        block.add_op(op)
        return op.results[0]

    slot_ids, guards, chunks = slot_tables(add, block.args[0], block.args[1], slots, 1, 1)
    block.add_op(func.ReturnOp(slot_ids, guards, chunks))
    fn = func.FuncOp("tables", ([a.type for a in block.args], [slot_ids.type, guards.type, chunks.type]), Region(block))
    got_ids, got_guards, got_chunks = run_function(ModuleOp([fn]), "tables", [ids, np.zeros((groups * group, 1), np.int32)])
    want_ids, want_guards = slot_reference(ids, slots)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_guards, want_guards)
    np.testing.assert_array_equal(got_chunks, ids)


def cost_only(path: str, dims: dict[str, int], options: str) -> SimReport:
    program = tcpc.compile_file(EXAMPLES / path, dims=dims)
    module = program.lower("pin-routing," + scheduled(options))
    name = program.function().sym_name.data
    report = simulate_cost_only(module, name, routing="balanced").report
    report.contractions = contraction_mappings(module, name)
    return report


STREAMED = dict(T=512, D=256, F=2048, E=8, K=2, B=16)
"""A Mixtral-style layer whose experts stream F tiles through 4 MB of SRAM: 128 rows per
expert under balanced routing, 8 blocks of 16."""


def test_a_weight_tile_crosses_hbm_once_per_expert_of_a_group() -> None:
    """Block order fetches an expert's streamed tiles for each of its 8 blocks; groups of 8
    blocks (an expert each, balanced) fetch them once; and the group's contractions take its
    128 rows at once, so the layer is several times faster."""
    weights = 3 * STREAMED["D"] * STREAMED["F"] * 2  # bytes of one expert's three matrices
    reports = {order: cost_only("mixtral.moe", STREAMED, f"order={order} group=8 sram_bytes=4000000")
               for order in ("block", "tile")}
    fetched = {order: sum(o.hbm_bytes for o in r.ops if o.name == "tile.load_expert") for order, r in reports.items()}
    assert fetched["block"] == 8 * STREAMED["E"] * weights
    assert fetched["tile"] == STREAMED["E"] * weights
    assert reports["tile"].total_cycles < reports["block"].total_cycles / 3


def test_a_chunk_of_padding_rows_is_neither_contracted_nor_stored() -> None:
    """75 rows per expert in blocks of 256: each block's second chunk of 128 rows is padding.
    Groups skip it (the contraction costs its share of the chunks that run) and store only the
    first: half the bytes block order stores, and fewer cycles."""
    dims = dict(T=300, D=64, F=256, E=8, K=2, B=256)
    reports = {order: cost_only("qwen3_moe.moe", dims, f"order={order} group=2") for order in ("block", "tile")}
    stored = {order: sum(o.hbm_bytes for o in r.ops if o.name == "tile.store" and o.phase == "experts")
              for order, r in reports.items()}  # the layer's output, stored by the combine, aside
    assert stored["block"] == 8 * 256 * 64 * 2 and stored["tile"] == stored["block"] // 2
    flops = {order: sum(o.flops for o in r.ops if o.name == "tcp.contract" and o.phase == "experts")
             for order, r in reports.items()}
    assert flops["tile"] == flops["block"] // 2


def test_a_group_of_small_blocks_contracts_at_the_mac_rate() -> None:
    """Qwen3-30B-A3B's blocks of 16 rows: one block's [16, 2048] x [2048, 768] keeps few
    multipliers busy (bound by fetch), a group's 16 blocks of one expert nearly all of them."""
    dims = dict(T=512, D=2048, F=768, E=32, K=8, B=16)  # 128 rows per expert
    mapped = {}
    for order in ("block", "tile"):
        report = cost_only("qwen3_moe.moe", dims, f"order={order} group=8")
        mapped[order] = next(c for c in report.contractions if c.phase == "experts")
    assert mapped["block"].utilization < 0.5 and mapped["block"].bound == "fetch"
    assert mapped["tile"].utilization > 0.95


SLOT_LOOP_CASES = {  # more than SLOTS_UNROLLED slots a group: a decode's groups
    "streamed, biases": ("gpt_oss.moe", dict(T=8, D=16, F=600, E=8, K=2, B=1), "order=tile group=8 sram_bytes=60000"),
    "resident, two groups": ("qwen3_moe.moe", dict(T=12, D=16, F=600, E=8, K=2, B=1), "order=tile group=8 f_tile=512"),
}


def commands(report: SimReport) -> list[tuple[object, ...]]:
    """Every costed command of a run (free ops, views and slices aside) as it ran."""
    return [(o.name, o.engine, o.phase, o.start, o.end, o.cycles, o.hbm_bytes, o.flops) for o in report.ops
            if o.engine != "none"]


@pytest.mark.parametrize("case", sorted(SLOT_LOOP_CASES))
def test_slots_in_a_loop_run_as_the_unrolled_slots(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group of more than SLOTS_UNROLLED slots runs those after the first as one loop body
    (`scf.for %slot`); against the same slots unrolled: the same output bits and, cost-only,
    the same commands at the same cycles and the same peak SRAM."""
    path, dims, options = SLOT_LOOP_CASES[case]
    program = tcpc.compile_file(EXAMPLES / path, dims=dims)
    runs = {}
    for form, unrolled in (("loop", _expert_groups.SLOTS_UNROLLED), ("unrolled", 1 << 30)):
        monkeypatch.setattr(_expert_groups, "SLOTS_UNROLLED", unrolled)
        module = program.lower(scheduled(options))
        slot_loops = [op for op in module.walk() if isinstance(op, scf.ForOp) and op.body.block.args[0].name_hint == "slot"]
        assert bool(slot_loops) == (form == "loop")
        runs[form] = (program.run(seed=3, pipeline=scheduled(options)).outputs, cost_only(path, dims, options))
    (looped, loop_report), (unrolled_outputs, unrolled_report) = runs["loop"], runs["unrolled"]
    assert_same_bits(looped, unrolled_outputs)
    assert loop_report.total_cycles == unrolled_report.total_cycles
    assert commands(loop_report) == commands(unrolled_report)
    assert loop_report.peak_sram_bytes == unrolled_report.peak_sram_bytes


GUESSED = dict(T=256, B=4)
"""Qwen3-style toy layer (E = 16, K = 4): 64 routed pairs per expert, prefill's regime."""


def guessed_loads_of(module: ModuleOp) -> list[Operation]:
    """The weight loads split-clusters made of a guessed first expert (`guessed_loads`)."""
    return [op for op in module.walk() if op.name == "tile.load_expert" and "_guessed" in (op.results[0].name_hint or "")]


def test_prefill_guesses_each_clusters_first_expert_while_the_router_runs() -> None:
    """At prefill (64 pairs per expert) each cluster loads expert c's carried weight tiles
    before the routing is known, during the router's time; under balanced routing the first
    slot of each cluster reuses them, so every expert's weights still cross HBM once. At
    decode below GUESS_PAIRS_PER_EXPERT (2 pairs per expert: T = 8) nothing is guessed."""
    report = cost_only("qwen3_moe.moe", GUESSED, "order=tile")
    guessed = [o for o in report.ops if o.name == "tile.load_expert" and "guessed" in o.label]
    assert len(guessed) == 2 * 3  # a cluster's gate, up and down tiles
    dispatch = min(o.start for o in report.ops if o.phase == "dispatch" and o.engine == "dma")
    assert max(o.end for o in guessed) <= dispatch
    reused = [o for o in report.ops if o.name == "tile.load_expert" and o.bound == "guard (reused)"]
    assert len(reused) == 2 * 3
    weights = 3 * 64 * 32 * 2  # one expert's three matrices, D = 64, F = 32, bf16
    assert sum(o.hbm_bytes for o in report.ops if o.name == "tile.load_expert") == 16 * weights
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", dims={"T": 8, "B": 4})
    assert not guessed_loads_of(program.lower("pin-routing," + scheduled("order=tile")))


def test_a_wrong_guess_costs_time_not_bits() -> None:
    """Prefill's loop (guessed first loads, the clusters slot by slot, the last stores by block)
    gives the reference's bits: for random tokens and router, and for a routing that never
    picks experts 0 and 1 (their router columns strongly negative for positive tokens), where
    the guessed tiles are not the first slots' experts, which load their own."""
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", dims=GUESSED)
    assert_same_bits(program.run(seed=3, pipeline=scheduled("order=tile")).outputs, program.run(seed=3).outputs)
    rng = np.random.default_rng(7)
    router = rng.standard_normal((64, 16)).astype(np.float32)
    router[:, :2] = -4.0
    inputs = {"x": np.abs(rng.standard_normal((256, 64))).astype(np.float32), "router": router}
    pipeline = scheduled("order=tile")
    assert guessed_loads_of(program.lower(pipeline))
    reference = program.run(inputs, seed=3)
    assert not np.isin([0, 1], np.argsort(-(reference.inputs["x"] @ reference.inputs["router"]), axis=1)[:, :4]).any()
    assert_same_bits(program.run(inputs, seed=3, pipeline=pipeline).outputs, reference.outputs)


GUESSED_FP8 = dict(T=256, B=16)
"""The fp8 toy layer (E = 16, K = 4): 64 routed pairs per expert, four blocks of 16 each."""


def assert_same_bits_unless_experts_0_and_1(program: tcpc.Program, pipeline: str, tokens: int) -> None:
    """The fp8 toy layer (D = 256, E = 16, K = 4) through `pipeline` gives the reference's bits for
    `tokens` positive tokens whose routing never picks experts 0 and 1 (their router columns
    strongly negative): where a guessed first expert is not the first block's."""
    rng = np.random.default_rng(7)
    router = rng.standard_normal((256, 16)).astype(np.float32)
    router[:, :2] = -4.0
    inputs = {"x": np.abs(rng.standard_normal((tokens, 256))).astype(np.float32), "router": router}
    reference = program.run(inputs, seed=3)
    assert not np.isin([0, 1], np.argsort(-(reference.inputs["x"] @ reference.inputs["router"]), axis=1)[:, :4]).any()
    assert_same_bits(program.run(inputs, seed=3, pipeline=pipeline).outputs, reference.outputs)


def test_a_block_loop_at_prefill_guesses_each_clusters_first_expert_too() -> None:
    """Block-scaled experts keep block order; at prefill their loop also starts from each
    cluster's guessed first expert, loaded before the dispatch's first DMA: the first block
    cluster c owns reuses it (each expert's 3 matrices reused by its 3 later blocks, plus the 2 x 3
    guessed), every expert's weights still cross HBM once, and a wrong guess costs no bits
    (experts 0 and 1 never routed). At decode below GUESS_PAIRS_PER_EXPERT (T = 8) nothing is guessed."""
    report = cost_only("qwen3_moe_fp8.moe", GUESSED_FP8, "order=block")
    guessed = [o for o in report.ops if o.name == "tile.load_expert" and "guessed" in o.label]
    assert len(guessed) == 2 * 3
    assert max(o.end for o in guessed) <= min(o.start for o in report.ops if o.phase == "dispatch" and o.engine == "dma")
    assert len([o for o in report.ops if o.name == "tile.load_expert" and o.bound == "guard (reused)"]) == 16 * 3 * 3 + 2 * 3
    assert sum(o.hbm_bytes for o in report.ops if o.name == "tile.load_expert") == 16 * 3 * 256 * 128  # f8: a byte each
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe_fp8.moe", dims=GUESSED_FP8)
    pipeline = scheduled("order=block")
    assert guessed_loads_of(program.lower(pipeline))
    assert_same_bits_unless_experts_0_and_1(program, pipeline, 256)
    decode = tcpc.compile_file(EXAMPLES / "qwen3_moe_fp8.moe", dims={"T": 8, "B": 4})
    assert not guessed_loads_of(decode.lower("pin-routing," + scheduled("order=block")))


def test_one_chip_at_decode_guesses_where_every_expert_is_almost_surely_used() -> None:
    """From GUESS_PAIRS_PER_EXPERT routed pairs per expert (4: the toy fp8 layer at T = 16,
    E = 16, K = 4; Qwen3-30B-A3B at T = 64) one chip's decode loop guesses each cluster's first
    expert too, loaded while the router ranks: the reference's bits, for a routing that never
    picks experts 0 and 1 as well; below (T = 8, 2 pairs per expert) nothing. At real dims
    (MXFP4, B = 4, balanced) the guessed loads end before the routing's ids and the first blocks
    reuse them: 251,784 -> 248,518 cycles (248,436 since the scales' gathers go right before the
    loop, after the dispatch's commands; 249,456 since the pinned routing is read after the router's
    top-k, `tcp.order`)."""
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe_fp8.moe", dims={"T": 16, "B": 4})
    pipeline = scheduled("order=block")
    assert len(guessed_loads_of(program.lower(pipeline))) == 2 * 3
    assert_same_bits(program.run(seed=5, pipeline=pipeline).outputs, program.run(seed=5).outputs)
    assert_same_bits_unless_experts_0_and_1(program, pipeline, 16)
    source = (EXAMPLES / "qwen3_moe_fp8.moe").read_text().replace("f8e4m3[E", "f4e2m1[E").replace("f32[E", "e8m0[E")
    real = tcpc.compile_source(source, dims=dict(T=64, B=4, D=2048, F=768, E=128, K=8, QK=32, QN=1, QG=32))
    module = real.lower("pin-routing," + scheduled("order=block"))
    report = simulate_cost_only(module, real.function().sym_name.data, routing="balanced").report
    guessed = [o for o in report.ops if o.name == "tile.load_expert" and "guessed" in o.label]
    ids = min(o.start for o in report.ops if o.phase == "experts" and o.name == "tcp.dma_gather")
    assert len(guessed) == 2 * 3 and max(o.end for o in guessed) <= ids
    assert report.total_cycles == 249_456


def test_a_block_loop_beside_a_shared_expert_guesses_nothing() -> None:
    """Beside a shared expert (DeepSeek-V3's fp8 layer, the same 64 routed pairs per expert as
    above) the routed loop guesses no first expert: the shared expert's weights need no routing,
    so its loads are the first to take HBM once the router is done (guessed loads issued right
    after the router came before them: DeepSeek-V3 MXFP4 at T = 2048, B = 64, 13,197,655 cycles
    without the guess, 13,229,918 with it)."""
    report = cost_only("deepseek_v3_fp8.moe", GUESSED_FP8, "order=block")
    loads = sorted((o for o in report.ops if o.name == "tile.load_expert" and o.hbm_bytes), key=lambda o: o.start)
    assert not [o for o in loads if "guessed" in o.label]
    assert loads[0].phase == "shared" and min(o.start for o in loads if o.phase == "experts") > loads[0].start
    program = tcpc.compile_file(EXAMPLES / "deepseek_v3_fp8.moe", dims=GUESSED_FP8)
    assert not guessed_loads_of(program.lower(scheduled("order=block")))


def branch_clusters(module: ModuleOp) -> list[int]:
    """The clusters of the `scf.if` ops at the top of the expert loop's body, in program order."""
    loop = next(op for op in module.walk() if op.name == "scf.for" and any(
        inner.name == "tile.load_expert" for inner in op.walk()))
    body = loop.regions[0].block
    return [op.attributes["tcpc.cluster"].value.data for op in body.ops if op.name == "scf.if"]  # type: ignore[attr-defined]


def test_prefill_alternates_the_clusters_slot_by_slot() -> None:
    """At prefill the two clusters' copies of a group alternate in program order: each one's
    rows and first slot, then the later slots in turn, then each one's stores (HBM serves the
    commands in issue order, so cluster 1 no longer trails cluster 0 by a whole group's DMA).
    At decode each copy stays whole: one branch per cluster."""
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", dims=GUESSED)
    clusters = branch_clusters(program.lower("pin-routing," + scheduled("order=tile group=4")))
    assert len(clusters) > 4 and clusters == [0, 1] * (len(clusters) // 2)
    decode = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", dims={"T": 16, "B": 4})
    assert branch_clusters(decode.lower("pin-routing," + scheduled("order=tile group=4"))) == [0, 1]


def test_the_loops_last_stores_are_one_command_per_block() -> None:
    """The group loop's last stores, which the combine waits for and nothing overlaps, are one
    DMA command per block, side by side on their own engines (a group's rows in one command of
    at most 1 MB ran on one engine); the stores inside the loop stay one per group."""
    report = cost_only("qwen3_moe.moe", GUESSED, "order=tile group=4")
    stores = sorted((o for o in report.ops if o.name == "tile.store" and o.phase == "experts" and o.hbm_bytes),
                    key=lambda o: o.start)
    block = 4 * 64 * 2  # B rows of D = 64 bf16
    last = [o for o in stores if o.start == stores[-1].start]
    assert len(last) == 4 and all(o.hbm_bytes == block for o in last)
    assert len({o.units for o in last}) == 4
    assert stores[0].hbm_bytes == 4 * block  # a group: 4 blocks of one expert (16 blocks each)


def test_qwen3_prefill_at_real_dims_alternates_its_clusters() -> None:
    """Qwen3-30B-A3B at T = 2048 (B = 128, order=tile: benchmarks/schedule.md's cell, within
    its 1.25x by about 335 cycles) keeps the clusters' slot-by-slot order: a group emitted in
    another shape (a slot loop) falls back to whole copies silently, about 4k cycles there."""
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", dims=dict(D=2048, F=768, E=128, K=8, T=2048, B=128))
    clusters = branch_clusters(program.lower("pin-routing," + scheduled("order=tile")))
    assert len(clusters) > 2 and clusters == [0, 1] * (len(clusters) // 2)


def test_the_tokens_quantization_runs_beside_the_routing_and_gives_the_same_bits() -> None:
    """Prefill with the tokens quantized once (lower-dispatch{quantize=tokens}) and the router's
    loop on both clusters: split-clusters runs the quantization on cluster 1, from its own load
    of the tokens, while cluster 0 computes the routing; the output is the reference's bits."""
    dims = dict(T=1024, B=16)
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe_fp8.moe", dims=dims)
    pipeline = scheduled("order=block").replace("lower-dispatch", "lower-dispatch{quantize=tokens}")
    module = program.lower(pipeline)
    (load,) = [op for op in module.walk() if op.name == "tcp.load" and op.results[0].name_hint == "x_sram_c1"]
    (xq,) = [op for op in module.walk() if op.results and op.results[0].name_hint == "xq_tokens"]
    assert cluster_of(load) == cluster_of(xq) == 1
    assert all(cluster_of(u.operation) == 1 for u in load.results[0].uses)
    assert_same_bits(program.run(seed=5, pipeline=pipeline).outputs, program.run(seed=5).outputs)


def test_the_routers_tiles_load_from_hbm_and_give_the_same_bits() -> None:
    """The router's token loop on both clusters: cluster 1's tiles of the tokens are loaded from
    HBM by rows (`tile.load %x`), not sliced from cluster 0's SRAM copy and copied across
    SRAM -> SRAM; and with the tokens' quantization on cluster 1 from a load of its own, cluster
    0's tiles load theirs too, so no whole copy of the tokens is made for the router; the output
    is the reference's bits."""
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe_fp8.moe", dims=dict(T=1024, B=16))
    pipeline = scheduled("order=block").replace("lower-dispatch", "lower-dispatch{quantize=tokens}")
    module = program.lower(pipeline)
    router = [op for op in module.walk() if phase_of(op) == "router"]
    tile_loads = [op for op in router if op.name == "tile.load"]
    assert {op.operands[0].name_hint for op in tile_loads} == {"x"}
    assert sorted(cluster_of(op) for op in tile_loads) == [0, 1]
    assert not [op for op in router if op.name in ("tile.slice", "tcp.load") and "x" in (op.operands[0].name_hint or "")]
    assert_same_bits(program.run(seed=5, pipeline=pipeline).outputs, program.run(seed=5).outputs)


def test_the_tokens_load_only_the_quantization_reads_moves_with_it() -> None:
    """DeepSeek-V3's f32 router loads its own token tiles, so the whole copy of the tokens is read
    by the quantization alone: split-clusters moves that load with it onto cluster 1, before the
    routing, and loads the tokens whole once (DeepSeek-V3 fp8 at T = 2048 read 29 MB twice, its
    quantization still after the routing); the output is the reference's bits."""
    program = tcpc.compile_file(EXAMPLES / "deepseek_v3_fp8.moe", dims=dict(T=1024, D=2048, B=16))
    pipeline = scheduled("order=block").replace("lower-dispatch", "lower-dispatch{quantize=tokens}")
    module = program.lower(pipeline)
    (fn,) = [op for op in module.ops if isinstance(op, func.FuncOp) and op.body.blocks]
    body = list(fn.body.block.ops)
    (load,) = [op for op in body if op.name == "tcp.load" and op.operands[0].name_hint == "x"]
    routing = next(i for i, op in enumerate(body) if phase_of(op) == "routing")
    assert cluster_of(load) == 1 and body.index(load) < routing
    assert all(cluster_of(u.operation) == 1 for u in load.results[0].uses)
    assert_same_bits(program.run(seed=5, pipeline=pipeline).outputs, program.run(seed=5).outputs)
