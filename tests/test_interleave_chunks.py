"""interleave-chunks (passes/schedule/interleave_chunks.py): the work between a chunked mesh chip's
expert loops spread into them keeps the bits, and pays at prefill."""

from pathlib import Path

import pytest
from xdsl.dialects import func, scf
from xdsl.dialects.builtin import ModuleOp

import tcpc
from tcpc.pipelines import apply_pipeline, parse_pipeline
from dialects import ccl, tcp, tile
from dialects.annotations import phase_of
from runtime_sim.perf.mesh_simulate import simulate_mesh
from target.mesh_machine import load_mesh_machine
from support import assert_same_bits, mesh_outputs
from tcpc.arrays import prepare_inputs
from tcpc.mesh_run import MeshSpec, split_arguments, token_outputs
from tcpc.program import function_in

EXAMPLES = Path(__file__).parent.parent / "examples"
SMALL = {"T": 256, "E": 8, "K": 2, "B": 16}
"""Qwen3-MoE's small dims on ep=2 in 2 chunks of 64 tokens: a chunk's 128 pairs fill 8 blocks."""


def _without(pipeline: str) -> str:
    return ",".join(p for p in pipeline.split(",") if p != "interleave-chunks")


def _loops(module: ModuleOp, phase: str) -> int:
    body = next(op for op in module.walk() if isinstance(op, func.FuncOp)).body.block
    return sum(1 for op in body.ops if isinstance(op, scf.ForOp) and phase_of(op) == phase)


ROUTER_TILE_BYTES = 150_000
"""Small enough that the router is tiled at SMALL's dims (at the machine's default share it is
whole below about 2,048 tokens a chip, which took this test 47 s): at 512 tokens a chip in 2
chunks of 256, rounds top-k, it takes 176 rows a trip (two tiles of 88), which schedule-tokens
makes 128 so that two trips make chunk 0, dispatched after them (golden: router_trips.moe, real
dims). One case for both: a chunk a trip (1,024 tokens a chip in 4 chunks of 256, the case it replaced) cuts
after the first trip the same way."""


@pytest.mark.parametrize("dims, spec, tile_bytes, loops, routers", [
    (SMALL, "ep=2,strategy=a2a,chunks=2", 0, (2, 4), (0, 0)),  # the router whole
    (SMALL, "ep=2,strategy=a2a_sum,chunks=2", 0, (2, 4), (0, 0)),
    (SMALL, "ep=2,tp=2,chunks=2", 0, (2, 5), (0, 0)),  # chunk 0's all-gather over tp before chunk 1's last quarter
    ({**SMALL, "T": 1024}, "ep=2,strategy=a2a,chunks=2,topk=rounds", ROUTER_TILE_BYTES, (2, 5), (1, 2)),
    ({**SMALL, "T": 1024}, "ep=2,strategy=a2a_sum,chunks=4", 0, (4, 11), (0, 0)),  # its golden: four_chunks.moe
])
def test_the_chunks_work_moved_into_the_loops_keeps_the_bits(dims: dict[str, int], spec: str, tile_bytes: int,
                                                             loops: tuple[int, int], routers: tuple[int, int]) -> None:
    """Every chip runs the IR before and after the pass on the same inputs: the same outputs,
    bit for bit; after it, each chunk's loop is in pieces around the moved work (SMALL: chunk
    0's cut before its last quarter, chunk 1's after its first), and the first dispatch follows
    the router's trips that make its rows (a second router loop)."""
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", dims=dims)
    spec = MeshSpec.parse(spec)
    after = spec.pipeline()
    if tile_bytes:
        after = after.replace("schedule-tokens", f"schedule-tokens{{tile_bytes={tile_bytes}}}")
    assert "interleave-chunks" in after.split(",")
    modules = [program.lower(pipeline) for pipeline in (_without(after), after)]
    assert tuple(_loops(module, "experts") for module in modules) == loops
    assert tuple(_loops(module, "router") for module in modules) == routers
    before, moved = mesh_outputs(program, spec, modules, 3)
    assert_same_bits(moved, before)


def test_the_pinned_routing_waits_for_chunk_0s_trips_alone() -> None:
    """Cost-only's routing argument (pin-routing's `tcp.order %routing after %top_e`): chunk 0's
    slice of it waits for the router's trips that make its rows, as the router's own indices do
    (one order after the first router loop, chunk 1's after the second), so its dispatch plan
    goes between the two loops. Every chip runs the IR before and after the pass on the same
    inputs and routing: the same outputs, bit for bit."""
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", dims={**SMALL, "T": 1024})
    spec = MeshSpec.parse("ep=2,strategy=a2a,chunks=2,topk=rounds")
    after = spec.pipeline(cost_only=True).replace("schedule-tokens", f"schedule-tokens{{tile_bytes={ROUTER_TILE_BYTES}}}")
    modules = [program.lower(pipeline) for pipeline in (_without(after), after)]
    body = next(op for op in modules[1].walk() if isinstance(op, func.FuncOp)).body.block
    routers = [op for op in body.ops if isinstance(op, scf.ForOp) and phase_of(op) == "router"]
    orders = [op for op in body.ops if isinstance(op, tcp.OrderOp)]
    assert [order.after.owner for order in orders] == routers
    plans = [op for op in body.ops if isinstance(op, ccl.A2APlanOp)]
    assert routers[0].is_before_in_block(plans[0]) and plans[0].is_before_in_block(routers[1])
    name = program.function(None).sym_name.data
    args = prepare_inputs(function_in(program.lower("pin-routing"), name), {}, 3)  # the routing of every token
    outputs = [token_outputs(spec.mesh, simulate_mesh(module, name, load_mesh_machine(),
                                                      split_arguments(module, name, spec.mesh, args)).outputs)
               for module in modules]
    assert_same_bits(outputs[1], outputs[0])


@pytest.mark.parametrize("dims, experts, split", [
    ({"T": 8, "D": 1024, "F": 32, "E": 2, "K": 2, "B": 1}, "schedule-experts", True),
    ({"T": 4, "D": 1024, "F": 1024, "E": 2, "K": 2, "B": 1}, "schedule-experts{f_tile=512}", False),
])
def test_the_stream_ends_in_pieces_with_the_same_bits(dims: dict[str, int], experts: str, split: bool) -> None:
    """Decode on ep=2 in 2 chunks, D = 1,024 (two GRID_K grains, two GRID_N): the last chunk's
    last round of the clusters' blocks (a loop piece of its own where a chunk's pairs fill more
    blocks than a round, `split`) loads its one-engine weights in pieces: each up projection's
    [1024, F] in two K pieces, a down projection's [F, 1024] in two column pieces, continuing the
    previous F tile's sum where F is in tiles of 512 (the second case); nothing of them is
    carried for reuse. Every chip runs the IR before and after the pass on the same inputs: the
    same outputs, bit for bit."""
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", dims=dims)
    spec = MeshSpec.parse("ep=2,strategy=a2a,chunks=2")
    names = [experts if name == "schedule-experts" else name for name in spec.pipeline().split(",")]
    at = names.index("interleave-chunks")
    passes = parse_pipeline(",".join(names[at:]))
    prefix = program.lower(",".join(names[:at]))
    before, after = apply_pipeline(prefix, passes[1:]), apply_pipeline(prefix, passes)
    last = [op for op in after.walk() if isinstance(op, scf.ForOp) and phase_of(op) == "experts"][-1]
    loads = [op for op in last.body.walk() if isinstance(op, tile.LoadExpertOp)]
    assert len(loads) == 2 * 6 * (1 if split else 2) and all(op.prev_ids is None for op in loads)
    assert _loops(after, "experts") == _loops(before, "experts") + split
    unchanged, cut = mesh_outputs(program, spec, [before, after], 3)
    assert_same_bits(cut, unchanged)


def _cycles(dims: dict[str, int], spec: str) -> list[int]:
    """Qwen3-MoE at `dims` on the mesh `spec`, cost-only under balanced routing: the slowest
    chip's cycles without interleave-chunks and with it."""
    program = tcpc.compile_file(EXAMPLES / "qwen3_moe.moe", dims=dims)
    mesh = MeshSpec.parse(spec)
    machine = load_mesh_machine()
    cycles = []
    for pipeline in (_without(mesh.pipeline(cost_only=True)), mesh.pipeline(cost_only=True)):
        module = program.lower(pipeline)
        cycles.append(simulate_mesh(module, program.function(None).sym_name.data, machine,
                                    cost_only=True).report.total_cycles)
    return cycles


@pytest.mark.parametrize("dims, spec, pinned", [
    ({"T": 2048, "D": 2048, "F": 768, "E": 128, "K": 8, "B": 128}, "ep=2,strategy=a2a_sum,chunks=2,topk=rounds",
     [1_083_604, 1_074_278]),
    ({"T": 8192, "D": 2048, "F": 768, "E": 128, "K": 8, "B": 128}, "ep=4,strategy=a2a_sum,chunks=4,topk=rounds",
     [1_184_368, 1_150_273]),
])
def test_prefill_cycles_pinned(dims: dict[str, int], spec: str, pinned: list[int]) -> None:
    """Qwen3-30B-A3B at 1,024 tokens a chip on 2 chips in 2 chunks, and at 2,048 on 4 in 4 (32
    filled blocks a loop), cost-only under balanced routing: the next chunk's receive before a
    loop's last quarter, the combine after the next loop's first, rather than both between the
    loops, and loop 0's DMA work that reads chunk 1's routing a round of the clusters' blocks
    after it; with 4 chunks the later dispatch plans before the first loop, and from the second
    loop on the next chunk's routing after a loop's first quarter (chunk 2's on the last
    cluster), its DMA row marks before the last (the routing and marks together before the last
    quarter, no plan moved, on main at 947c7aa: 1,095,459 -> 1,089,836 and 1,208,185 ->
    1,186,569 cycles; the first cycles here, without the pass, have schedule-tokens' router
    tiles of a chunk and home sums in HBM, and since, each chunk's home sum stored straight into
    the layer's output, the last one's in a tile per DMA engine: 1,091,363/1,082,035 and
    1,204,206/1,168,953 before; 1,086,767/1,077,439 and 1,188,165/1,152,972 before the plans'
    cumsums were chunked as lower-routing's; 2,048 a chip: 1,156,726 with the pass before chunk 0's
    slice of the pinned routing waited for the router's first trips alone)."""
    assert _cycles(dims, spec) == pinned


def test_decode_tp_cycles_pinned() -> None:
    """Qwen3-30B-A3B on ep=2,tp=2 at 16 tokens a chip, B = 2, 8 chunks (benchmarks/mesh.py's
    row), cost-only under balanced routing: chunk 6's all-gather over tp goes on the link before
    chunk 7's reduce-scatter and return instead of after them (240,938 cycles before), 1.3 us
    off the tail (239,626; 239,783 with the chunked router's tiles of a chunk and the home sums
    in HBM, which this row does not gain from; 239,514 with the last round's one-engine weights
    in pieces, test_the_stream_ends_in_pieces_with_the_same_bits; 239,984 with the pinned routing read
    after the router's top-k, `tcp.order`)."""
    before, after = _cycles({"T": 32, "D": 2048, "F": 768, "E": 128, "K": 8, "B": 2}, "ep=2,tp=2,chunks=8")
    assert after == 239_984
    assert after < before
