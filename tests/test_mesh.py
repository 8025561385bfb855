"""Expert parallelism across chips: the sharded program on every chip against the single-chip
reference, the exact static bounds by brute force, the mesh files, the reports."""

from __future__ import annotations

import io
import itertools
import json
import math
import re
import threading
from pathlib import Path

import numpy as np
import pytest
from xdsl.utils.exceptions import InterpretationError, PassFailedException

import tcpc
from dialects import ccl, moe, tile
from target.machine import MachineError
from target.mesh_machine import load_mesh_machine
from runtime_sim.semantics.ccl_semantics import (MeshExchange, a2a_plan, a2a_returns, a2a_token_lists, a2a_tokens,
                                                   all_to_all, reduce_sum)
from runtime_sim.semantics.tolerance import compare_outputs
from tcpc.cli import main
from tcpc.mesh_run import MeshSpec, check_on_mesh, simulate_on_mesh

CAPACITY_LAYER = """
dims T = 8, D = 8, F = 16, E = 4, K = 2, B = 2, C = 3
graph capped(x: bf16[T, D], router: f32[D, E], w_up: bf16[E, D, F], w_down: bf16[E, F, D]) -> bf16[T, D] {
    probs = softmax(f32(x) @ router)
    top_p, top_e = topk(probs, K)
    xb, route = scatter(x, top_e, experts=E, block=B, capacity=C)
    h = silu(grouped_matmul(xb, w_up, route))
    return combine(grouped_matmul(h, w_down, route), route, bf16(top_p))
}
"""


def _checked(program: tcpc.Program, spec: str, seed: int = 0) -> tuple[list, object]:
    sim = simulate_on_mesh(program, MeshSpec.parse(spec), seed=seed)
    ref = program.run(seed=seed)
    return compare_outputs(sim.outputs, ref.outputs), sim


@pytest.mark.parametrize("example, spec", [
    ("examples/deepseek_v3.moe", "ep=4"),
    ("examples/deepseek_v3.moe", "ep=8"),
    ("examples/qwen3_moe.moe", "dp=2,ep=2"),
    ("examples/toy.moe", "ep=2"),
    ("examples/llama4.moe", "ep=2"),  # the scattered rows are x times the router score, computed at home
])
def test_a2a_is_bit_identical_to_one_chip(example: str, spec: str) -> None:
    results, sim = _checked(tcpc.compile_file(example), spec)
    assert all(c.identical for c in results), [c.message for c in results]
    assert len(sim.report.chips) == MeshSpec.parse(spec).mesh.chips


def test_a2a_is_bit_identical_where_a_chips_rows_are_fewer_than_a_tiles() -> None:
    """DeepSeek-V3 at D = 512 on 8 chips: each chip's router multiplies 16 of the 128 token
    rows, which BLAS rounded otherwise than in the reference's 128-row product (4 ulp off,
    outside the tolerance) until every tile product held 128 rows (numerics._matmul_f32)."""
    dims = {"T": 128, "E": 32, "K": 8, "NG": 8, "TG": 4, "D": 512}
    results, _ = _checked(tcpc.compile_file("examples/deepseek_v3.moe", dims=dims), "ep=8")
    assert all(c.identical for c in results), [c.message for c in results]


def test_a2a_is_bit_identical_where_a_chips_router_is_cut_into_a_tile_per_cluster() -> None:
    """DeepSeek-V3 at D = 2048, E = 64 on 8 chips at 128 tokens each: each chip's f32 router runs
    in two 64-row tiles, one per cluster (schedule-tokens' `sharing_pays`), rows the reference
    multiplies in one 1,024-row product, and gives its bits. Its tokens are f32(x) * 1.0, not a
    widened bf16: on nine bf16 piece pairs the tiles pay (on the widened tokens' one piece, three
    pairs, the router stays whole)."""
    dims = {"T": 1024, "E": 64, "K": 8, "NG": 8, "TG": 4, "D": 2048, "B": 16}
    source = Path("examples/deepseek_v3.moe").read_text().replace("f32(x) @ router", "(f32(x) * 1.0) @ router")
    program = tcpc.compile_source(source, dims=dims)
    results, sim = _checked(program, "ep=8,topk=rounds")
    router = [loop for loop in sim.report.loops if loop.phase == "router"]
    assert len(router) == 1 and "bf16[64, 2048]" in router[0].tiles, router  # the tokens' tile: the matmul's
    assert all(c.identical for c in results), [c.message for c in results]


def test_a2a_capacity_drops_what_one_chip_drops() -> None:
    program = tcpc.compile_source(CAPACITY_LAYER)
    for seed in range(3):
        results, _ = _checked(program, "ep=2", seed)
        assert all(c.identical for c in results)


@pytest.mark.parametrize("spec", ["dp=2,ep=2", "dp=2,ep=2,strategy=allgather", "dp=2,tp=2"])
def test_capacity_with_dp_drops_what_one_chip_drops(spec: str) -> None:
    """C = 3 of 16 pairs over 4 experts drops pairs; the groups rank their pairs after the
    earlier groups' (each chip's per-expert counts gathered over ep and dp), as one chip does."""
    program = tcpc.compile_source(CAPACITY_LAYER)
    for seed in range(3):
        results, _ = _checked(program, spec, seed)
        assert all(c.identical for c in results), [c.message for c in results]


def test_ranking_after_earlier_shards_keeps_what_one_chip_keeps() -> None:
    """Every routing of two token shards (one token each, K = 2, E = 4): the pairs the two
    plans send are exactly those one chip's scatter keeps, so no receiver drops any, and
    no count exceeds the static slots."""
    from runtime_sim.semantics.moe_semantics import route_plan

    rows = list(itertools.permutations(range(4), 2))
    for capacity in (1, 2):
        s = ccl.a2a_slots(1, 2, 2, capacity)
        for routing in itertools.product(rows, repeat=2):
            choices = np.array(routing, dtype=np.int32)
            counts = np.stack([np.bincount(c, minlength=4) for c in choices])
            sent = []
            for shard in range(2):
                slot_rows, _, send = a2a_plan(choices[shard:shard + 1], 2, 4, s, capacity, counts[:shard].sum(axis=0))
                assert send.max() <= s
                sent.append(slot_rows[0] >= 0)
            kept = route_plan(choices, moe.RouteType.make(2, 2, 4, 1, capacity)).scatter_idx >= 0
            assert np.array_equal(np.stack(sent), kept), (routing, capacity)


def test_allgather_within_tolerance() -> None:
    for example in ("examples/deepseek_v3.moe", "examples/mixtral.moe"):
        results, _ = _checked(tcpc.compile_file(example), "ep=4,strategy=allgather")
        assert all(c.ok for c in results), [c.message for c in results]


@pytest.mark.parametrize("example, spec", [
    ("examples/toy.moe", "ep=2"),
    ("examples/deepseek_v3.moe", "ep=4"),       # a shared expert, group-limited routing
    ("examples/qwen3_moe.moe", "dp=2,ep=2"),
    ("examples/llama4.moe", "ep=2"),             # a combine without weights
    ("examples/gpt_oss.moe", "ep=2,tp=2"),       # tp: the blocks summed over tp first
])
def test_a2a_sum_within_tolerance(example: str, spec: str) -> None:
    program = tcpc.compile_file(example)
    parsed = MeshSpec.parse(f"{spec},strategy=a2a_sum")
    sim = simulate_on_mesh(program, parsed, seed=1)
    results = check_on_mesh(program, parsed, sim, seed=1)
    assert all(c.ok for c in results), [c.message for c in results]


@pytest.mark.parametrize("spec", ["ep=2", "dp=2,ep=2"])
def test_a2a_sum_capacity_keeps_what_one_chip_keeps(spec: str) -> None:
    program = tcpc.compile_source(CAPACITY_LAYER)
    for seed in range(3):
        parsed = MeshSpec.parse(f"{spec},strategy=a2a_sum")
        results = check_on_mesh(program, parsed, simulate_on_mesh(program, parsed, seed=seed), seed=seed)
        assert all(c.ok for c in results), [c.message for c in results]


@pytest.mark.parametrize("whole_first", [False, True])
@pytest.mark.parametrize("tokens, k, experts, chips", [(3, 2, 4, 2), (2, 3, 6, 3), (4, 2, 8, 4), (2, 4, 4, 2)])
def test_token_lists_hold_each_tokens_pairs_in_k_order(tokens: int, k: int, experts: int, chips: int,
                                                       whole_first: bool) -> None:
    """Every routing of small sizes (400 drawn where there are too many): the list a
    destination gets for a token (at the token's row of the send buffer, in either order) is
    its kept pairs there, in k order, then -1; weights alike."""
    per_chip = experts // chips
    entries = min(k, per_chip)
    s = ccl.a2a_slots(tokens, k, per_chip)
    weights = np.arange(1, tokens * k + 1, dtype=np.float32).reshape(tokens, k)
    rows = list(itertools.permutations(range(experts), k))
    if len(rows) ** tokens <= 3000:
        routings = [np.array(r, dtype=np.int32) for r in itertools.product(rows, repeat=tokens)]
    else:  # 400 of them, drawn (56^4 is 9.8 million)
        rng = np.random.default_rng(0)
        routings = [np.array([rows[i] for i in rng.integers(0, len(rows), tokens)], dtype=np.int32) for _ in range(400)]
    for choices in routings:
        slot_rows, _, _ = a2a_plan(choices, chips, experts, s)
        token_rows, _, _ = a2a_tokens(slot_rows, chips, s, 0, whole_first)
        experts_at = a2a_token_lists(slot_rows, choices, chips, s, entries, whole_first)
        weights_at = a2a_token_lists(slot_rows, weights, chips, s, entries, whole_first)
        for t in range(tokens):
            for d in range(chips):
                pairs = [j for j in range(k) if choices[t, j] // per_chip == d]
                if not pairs:
                    assert token_rows[t, d] == -1
                    continue
                row = token_rows[t, d] - d * tokens
                padding = entries - len(pairs)
                assert experts_at[d, row].tolist() == [choices[t, j] for j in pairs] + [-1] * padding
                assert weights_at[d, row].tolist() == [weights[t, j] for j in pairs] + [0.0] * padding


@pytest.mark.parametrize("whole_first", [False, True])
@pytest.mark.parametrize("tokens, k, experts, chips", [(3, 2, 4, 2), (2, 3, 6, 3), (2, 2, 8, 4)])
def test_a2a_returns_sum_whole_tokens_where_they_sit(tokens: int, k: int, experts: int, chips: int,
                                                     whole_first: bool) -> None:
    """ccl.a2a_returns over every routing of small sizes, with a capacity that drops pairs: a
    token whose kept pairs all go to one chip comes home from its row there (the row
    a2a_tokens sent it in, which the receiver's combine over its list fills); every kept pair
    of a split token is listed for its chip in slot order, as its entry in the token's list
    there (the token's row, its place among the token's pairs there in k order), and comes
    home from its own row; the counts say how many split pairs. The sums that go back are the
    head of each slice: with `whole_first` the whole tokens' rows, which come first, else all."""
    per_chip = experts // chips
    entries, me = min(k, per_chip), 1
    slots = ccl.a2a_slots(tokens, k, per_chip, 1)
    for choice in itertools.product(itertools.permutations(range(experts), k), repeat=tokens):
        top = np.array(choice, dtype=np.int32)
        rows, _, _ = a2a_plan(top, chips, experts, slots, capacity=1)
        pair_slots, pair_counts, token_returns, pair_returns, sum_counts = a2a_returns(rows, chips, slots, entries,
                                                                                       me, whole_first)
        token_rows, _, counts = a2a_tokens(rows, chips, slots, me, whole_first)
        dest = [sorted({int(r) // slots for r in rows[t] if r >= 0}) for t in range(tokens)]
        whole = [sum(1 for t in range(tokens) if dest[t] == [d]) for d in range(chips)]
        assert sum_counts.tolist() == (whole if whole_first else counts.tolist())
        for d in range(chips):
            split = sorted(int(r) for t in range(tokens) for r in rows[t] if r >= 0 and r // slots == d
                           and len(dest[t]) > 1)
            assert pair_counts[d] == len(split)
            assert not pair_slots[d, len(split):].any()
            for p, x in enumerate(split):
                t, j = (int(i) for i in np.argwhere(rows == x)[0])
                row = token_rows[t, d] - d * tokens  # the token's row in the send buffer for d
                before = sum(1 for i in range(j) if rows[t, i] >= 0 and rows[t, i] // slots == d)  # its place in the list
                assert pair_slots[d, p] == (me * tokens + row) * entries + before + 1
                assert pair_returns[t, j] == d * slots + p
        for t in range(tokens):
            if len(dest[t]) == 1:
                assert token_returns[t, 0] == token_rows[t, dest[t][0]]
                assert token_returns[t, 0] - dest[t][0] * tokens < sum_counts[dest[t][0]]  # its sum goes back
                assert (pair_returns[t] == -1).all()
            else:
                assert token_returns[t, 0] == -1
                assert ((pair_returns[t] >= 0) == (rows[t] >= 0)).all()


def test_a2a_returns_one_row_per_whole_token_bit_identical() -> None:
    """Qwen3's small layer on 2 chips (E = 16, K = 4: a token's pairs often sit on one chip,
    often on both): the receivers' sums of whole tokens and the home's sums of split tokens
    both occur, and the outputs are one chip's bit for bit; the return moves fewer rows than
    one per pair (T = 16 tokens, K = 4). Only the whole tokens' sums go back, the head of each
    slice (a destination's whole tokens ranked first): fewer rows than tokens were sent."""
    program = tcpc.compile_file("examples/qwen3_moe.moe")
    results, sim = _checked(program, "ep=2", seed=3)
    assert all(c.identical for c in results), [c.message for c in results]
    links = sim.report.links
    sums = sum(x.sent_bytes for x in links if x.label.startswith("%returned_sums ="))
    pairs = sum(x.sent_bytes for x in links if x.label.startswith("%returned ="))
    tokens = sum(x.sent_bytes for x in links if x.label.startswith("%recv_x ="))
    assert sums > 0 and pairs > 0
    assert sums < tokens  # a split token's sum stays on its receiver
    row_bytes = 2 * 64
    assert (sums + pairs) // row_bytes < 16 * 4


def test_a2a_receiver_sums_straight_from_the_blocks() -> None:
    """a2a's receiver makes no row per pair: its one combine sums the tokens it received
    straight from the blocks, weighted (the whole tokens' rows go home from there), and only
    the split tokens' pairs are gathered from the blocks one row each. On the same inputs
    (DeepSeek-V3's group-limited routing at small sizes, 4 chips: whole and split tokens both
    occur) the outputs are one chip's bit for bit."""
    program = tcpc.compile_file("examples/deepseek_v3.moe")
    chip = str(program.lower(MeshSpec.parse("ep=4").pipeline(lowered=False)))
    combines = re.findall(r"= moe.combine .*", chip)
    assert len(combines) == 1 and " weights " in combines[0]
    assert "moe.pair_rows" in chip and "%split_rows = tcp.dma_gather %y_rows[%split_at]" in chip
    results, sim = _checked(program, "ep=4", seed=2)
    assert all(c.identical for c in results), [c.message for c in results]
    split = sum(x.sent_bytes for x in sim.report.links if x.label.startswith("%returned ="))
    assert split > 0  # some token's pairs sat on two chips


def test_a2a_sum_returns_one_bf16_row_per_token_and_chip() -> None:
    """The toy layer (T = 4, D = 8, E = 4, K = 2) on 2 chips: each chip returns one bf16 row
    per token it received, the bytes it received them in, and receives no slot tokens (nor
    does a2a's receiver, which routes tokens too, where sp does not)."""
    program = tcpc.compile_file("examples/toy.moe")
    sums = simulate_on_mesh(program, MeshSpec.parse("ep=2,strategy=a2a_sum"), seed=0).report
    assert sum(x.sent_bytes for x in sums.links if x.label.startswith("%returned")) > 0
    pairs = simulate_on_mesh(program, MeshSpec.parse("ep=2"), seed=0).report
    returned = {x.chip: x.sent_bytes for x in sums.links if x.label.startswith("%returned")}
    dispatched = {x.chip: x.sent_bytes for x in sums.links if x.label.startswith("%recv_x")}
    assert returned == dispatched  # the tokens came in bf16 and their sums go back in bf16
    assert not any(x.label.startswith("%recv_slot_tokens") for x in sums.links)
    assert not any(x.label.startswith("%recv_slot_tokens") for x in pairs.links)


def test_a2a_sum_tolerance_is_the_receivers_rounding() -> None:
    """Tokens whose pairs sit on two chips (toy, E/ep = 1): each chip's bf16-rounded part moves
    the output by at most RECEIVER_SUM_SCALE * A, and check_on_mesh allows exactly that."""
    from runtime_sim.semantics.tolerance import RECEIVER_SUM_SCALE, compare_outputs

    program = tcpc.compile_file("examples/toy.moe")
    spec = MeshSpec.parse("ep=4,strategy=a2a_sum")
    for seed in range(4):
        sim = simulate_on_mesh(program, spec, seed=seed)
        assert all(c.ok for c in check_on_mesh(program, spec, sim, seed=seed))
    ref = program.run(sim.inputs, seed=seed, reference=True)
    strict = compare_outputs(sim.outputs, ref.outputs)  # without the allowance: fails where parts were rounded
    assert RECEIVER_SUM_SCALE == 3 * 2.0**-8 and not all(c.identical for c in strict)


def test_semantics_over_all_chips() -> None:
    values = [np.arange(6).reshape(3, 2) + 10 * c for c in range(3)]
    out = all_to_all(values)
    assert out[1][2].tolist() == values[2][1].tolist()
    halves = [np.float32(1e8), np.float32(1.0), np.float32(-1e8)]
    # chip order: (1e8 + 1) + -1e8 = 0 in f32; another order would give 1
    assert reduce_sum([np.array([h]) for h in halves], np.dtype(np.float32))[0] == 0.0


def _receive_counts(choices: np.ndarray, chips: int, experts: int, capacity: int | None) -> list[int]:
    """Pairs each destination gets from one chip: a2a_plan's counts."""
    s = ccl.a2a_slots(choices.shape[0], choices.shape[1], experts // chips, capacity)
    return a2a_plan(choices, chips, experts, s, capacity)[2].tolist()


@pytest.mark.parametrize("tokens, k, experts, chips", [(2, 2, 4, 2), (3, 2, 4, 2), (2, 3, 6, 3), (3, 1, 4, 4)])
def test_send_buffers_are_the_exact_worst_case(tokens: int, k: int, experts: int, chips: int) -> None:
    rows = list(itertools.permutations(range(experts), k))
    for capacity in (None, 1, 2):
        worst = 0
        for routing in itertools.product(rows, repeat=tokens):
            counts = _receive_counts(np.array(routing, dtype=np.int32), chips, experts, capacity)
            worst = max(worst, max(counts))
        assert worst == ccl.a2a_slots(tokens, k, experts // chips, capacity), capacity


@pytest.mark.parametrize("tokens, k, experts, chips, block", [(2, 2, 4, 2, 1), (2, 2, 4, 2, 2), (1, 2, 6, 3, 2), (1, 3, 6, 2, 2)])
def test_receive_blocks_are_the_exact_worst_case(tokens: int, k: int, experts: int, chips: int, block: int) -> None:
    """G of a receiving chip's scatter is the most blocks any routing of the group's tokens fills."""
    per_chip = experts // chips
    group_tokens = tokens * chips
    rows = list(itertools.combinations(range(experts), k))
    for capacity in (None, 2):
        cap = min(capacity or group_tokens, group_tokens)
        s = ccl.a2a_slots(tokens, k, per_chip, capacity)
        g = moe.RouteType.make(chips * s, 1, per_chip, block, cap).blocks.data
        worst = 0
        for routing in itertools.product(rows, repeat=group_tokens):
            mine = np.array(routing)  # the receiving chip owns experts [0, E/n)
            counts = [min(int((mine == e).sum()), cap) for e in range(per_chip)]
            worst = max(worst, sum(math.ceil(c / block) for c in counts))
        assert worst == g


def test_mesh_errors_are_clear(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert main(["run", "examples/deepseek_v3.moe", "--mesh", "ep=3"]) == 1
    assert "E = 16 experts do not divide over ep = 3 chips" in capsys.readouterr().err
    assert main(["run", "examples/deepseek_v3.moe", "--mesh", "ep=4,xp=2"]) == 1
    assert "unknown 'xp' (expected axes dp, ep, sp, tp as NAME=SIZE" in capsys.readouterr().err
    # allgather keeps a token's K choices on every chip: E/ep < K cannot route (toy: E = 4, K = 2).
    assert main(["run", "examples/toy.moe", "--mesh", "ep=4,strategy=allgather"]) == 1
    assert "leave 1 per chip, fewer than K; use strategy=a2a or a2a_sum" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    for text, message in [
        ('chip = "rngd"\n[link]\nbytes_per_cycle = { value = 0, source = "x" }\nlatency_cycles = { value = 1, assumption = "y" }\n',
         "[link] bytes_per_cycle: must be positive"),
        ('chip = "rngd"\n[link]\nbytes_per_cycle = { value = 30, source = "x" }\n', "[link] latency_cycles: missing"),
        ('[link]\nbytes_per_cycle = { value = 30, source = "x" }\nlatency_cycles = { value = 1, assumption = "y" }\n',
         "chip: missing"),
        ('extends = "rngd_pcie"\n[mesh]\nshape = [2, 0]\n', "[mesh] shape: expected a list of positive integers"),
        ('extends = "rngd_pcie"\n[link]\nbandwidth = 3\n', "[link] bandwidth: unknown key"),
        ('extends = "rngd_pcie"\nchip = "tpu"\n', "chip: 'tpu' is neither a built-in chip machine (rngd, rngd-cluster)"),
        ('this is not a mesh file ]]\n', "not valid TOML"),
    ]:
        bad.write_text(text)
        with pytest.raises(MachineError, match=re.escape(message)):
            load_mesh_machine(bad)
        assert main(["run", "examples/toy.moe", "--mesh", "ep=2", "--mesh-machine", str(bad)]) == 1
        assert capsys.readouterr().err.startswith("tcpc: error: ")
    assert main(["run", "examples/deepseek_v3.moe", "--mesh", "ep=4", "--mesh-machine",
                 "target/machines/rngd_2x4.toml"]) == 1
    assert "has 8 (shape 2 x 4)" in capsys.readouterr().err


def test_mesh_mixups_are_clear(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """A chip machine given as the mesh file, a mesh file given as the chip, an option --mesh
    does not have: each named, exit 1; a built-in mesh file by name works as --machine's do."""
    for spec, message in [("ep=2,capacity=4", "unknown 'capacity' (expected axes dp, ep, sp, tp as NAME=SIZE, and the "
                                              "options strategy=, topk=, tokens=, chunks=, sp_sum=, waves=); a "
                                              "capacity is the program's"),
                          ("ep=2,chunks=0", "chunks = '0' is neither a positive integer nor auto"),
                          ("strategy=a2a,xp=2", "unknown 'xp'"), ("ep=-1", "ep must be positive, got -1"),
                          ("ep=2,dp=3", "T = 16 tokens do not divide over dp * ep = 6 chips"),
                          ("ep=2,tp=3", "F = 32 does not divide over tp = 3 chips")]:
        assert main(["run", "examples/deepseek_v3.moe", "--mesh", spec]) == 1
        assert message in capsys.readouterr().err
    assert main(["run", "examples/toy.moe", "--mesh", "ep=2", "--mesh-machine",
                 "target/machines/rngd.toml"]) == 1
    assert "link: missing: this is a single-chip machine file" in capsys.readouterr().err
    bad = tmp_path / "mesh_as_chip.toml"
    bad.write_text('extends = "rngd_pcie"\nchip = "rngd_2x4"\n')
    assert main(["run", "examples/toy.moe", "--mesh", "ep=2", "--mesh-machine", str(bad)]) == 1
    assert f"{bad}: chip: 'rngd_2x4' is a mesh file" in capsys.readouterr().err
    bad.write_text('extends = "rngd_pcie"\nchip = 5\n')
    assert main(["run", "examples/toy.moe", "--mesh", "ep=2", "--mesh-machine", str(bad)]) == 1
    assert "chip: expected a string, got 5" in capsys.readouterr().err
    assert load_mesh_machine("rngd_2x4").chips == 8
    assert main(["run", "examples/toy.moe", "--mesh", "dp=2,ep=4", "--set", "T=8", "--mesh-machine", "rngd_2x4"]) == 0


@pytest.mark.parametrize("example", ["qwen3_moe_fp8.moe", "gpt_oss_mxfp4.moe"])
def test_block_scaled_experts_on_a_mesh_are_refused_clearly(capsys: pytest.CaptureFixture[str], example: str) -> None:
    """fp8 and MXFP4 experts (moe.scaled_grouped_matmul) are not sharded yet: a clear error,
    exit 1, not an internal one from IR that shard-experts left half sharded."""
    assert main(["run", f"examples/{example}", "--mesh", "ep=2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tcpc: error: shard-experts: @") and "are block-scaled" in err and "internal" not in err


def test_cli_check_report_and_trace(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    trace, report = tmp_path / "t.json", tmp_path / "r.json"
    assert main(["run", "examples/deepseek_v3.moe", "--mesh", "ep=8", "--check", "--report",
                 "--trace", str(trace), "--report-json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "check: outputs equal the reference" in out and "load imbalance" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == set(range(1, 9))
    assert any(e.get("cat") == "link" for e in events)
    data = json.loads(report.read_text())
    assert len(data["chips"]) == 8 and data["total_cycles"] == max(c["total_cycles"] for c in data["chips"])
    assert main(["compile", "examples/toy.moe", "--mesh", "ep=2"]) == 0
    assert "ccl.all_to_all" in capsys.readouterr().out


def test_deepseek_routing_on_8_chips_checks(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/mesh.md's acceptance line: DeepSeek-V3's routing (E = 256, top-8 of 4 of 8 groups) at
    small D and F, 32 experts per chip, bit-identical to one chip."""
    sets = [a for d in ("E=256", "K=8", "NG=8", "TG=4", "T=64") for a in ("--set", d)]
    assert main(["run", "examples/deepseek_v3.moe", *sets, "--mesh", "ep=8", "--check", "--report"]) == 0
    out = capsys.readouterr().out
    assert "check: out0 identical" in out and "hottest chip" in out


def test_skewed_routing_shows_the_hot_chip() -> None:
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims={"T": 32, "B": 4})  # small blocks: the skew shows
    spec = MeshSpec.parse("ep=4")
    balanced = simulate_on_mesh(program, spec, cost_only=True, routing="balanced").report
    skewed = simulate_on_mesh(program, spec, cost_only=True, routing="skewed", seed=1).report
    received = [sum(x.received_bytes for x in skewed.links if x.chip == c and x.label.startswith("%recv_x ="))
                for c in range(4)]
    assert max(range(4), key=received.__getitem__) == 0  # Zipf: experts 0.. are the popular ones: their tokens
    assert len({balanced.link_bytes(c)[1] for c in range(4)}) == 1
    sent = [skewed.link_bytes(c)[0] for c in range(4)]  # the hot chip returns a row per pair it computed
    busy = [skewed.compute_busy(c) for c in range(4)]
    assert skewed.imbalance(sent) > 1.2 and skewed.imbalance(busy) > 1.2


def test_cost_only_with_chips_that_receive_nothing(tmp_path) -> None:
    """8 tokens x K = 8 on experts 0..63 of 256 (token t on 8t..8t+7): chips 2..7 receive no
    pair, skip their expert loops and send back real zeros where chips 0 and 1 send
    placeholders; the chips still meet at every collective (this hung)."""
    program = tcpc.compile_file("examples/deepseek_v3.moe", dims={"T": 8, "E": 256, "K": 8, "NG": 8, "TG": 4, "B": 1})
    routing = tmp_path / "first_64.npy"
    np.save(routing, np.arange(64, dtype=np.int32).reshape(8, 8))
    report = simulate_on_mesh(program, MeshSpec.parse("ep=8"), cost_only=True, routing=routing).report
    received = [report.link_bytes(c)[1] for c in range(8)]
    assert received[0] > 0 and received[1] > 0
    assert len({len([x for x in report.links if x.chip == c]) for c in range(8)}) == 1


@pytest.mark.parametrize("whole_first", [False, True])
@pytest.mark.parametrize("tokens, k, experts, chips", [(3, 2, 4, 2), (2, 3, 6, 3), (2, 2, 8, 4)])
def test_token_dispatch_fills_every_slot_with_its_token(tokens: int, k: int, experts: int, chips: int,
                                                        whole_first: bool) -> None:
    """ccl.a2a_tokens over every routing of small sizes, in either order: each token crosses
    once to each chip holding one of its pairs, and the receiver's copy by slot puts in every
    slot exactly the token a per-pair send would have put there; with `whole_first` a
    destination's whole tokens take its first rows."""
    from runtime_sim.semantics.ccl_semantics import a2a_tokens

    slots = ccl.a2a_slots(tokens, k, experts // chips)
    for choice in itertools.product(itertools.permutations(range(experts), k), repeat=tokens):
        top = np.array(choice, dtype=np.int32)
        rows, _, _ = a2a_plan(top, chips, experts, slots)
        me = 1
        token_rows, slot_tokens, counts = a2a_tokens(rows, chips, slots, me, whole_first)
        owners = top // (experts // chips)
        assert counts.tolist() == [int((owners == d).any(axis=1).sum()) for d in range(chips)]
        if whole_first:
            whole = (owners == owners[:, :1]).all(axis=1)
            for d in range(chips):
                at = token_rows[:, d] - d * tokens
                if (at[whole] >= 0).any() and (at[~whole] >= 0).any():
                    assert at[whole][at[whole] >= 0].max() < at[~whole][at[~whole] >= 0].min()
        sent = np.full(chips * tokens, -1)
        for t in range(tokens):
            for d in np.flatnonzero(token_rows[t] >= 0):
                sent[token_rows[t, d]] = t  # the token send buffer: token t in chip d's slice
        by_slot = np.full(chips * slots, -1)
        by_slot[rows[rows >= 0]] = np.broadcast_to(np.arange(tokens)[:, None], rows.shape)[rows >= 0]
        for d in range(chips):  # chip d's receive buffer holds this chip's slice d at slice `me`
            got = [sent[d * tokens + v - me * tokens] if v >= 0 else -1 for v in slot_tokens[d]]
            assert got == by_slot[d * slots:(d + 1) * slots].tolist()


def test_chips_meeting_at_different_points_is_an_error() -> None:
    exchange = MeshExchange(ccl.Mesh.parse("ep=2"))
    errors: list[BaseException] = []

    def chip(c: int) -> None:
        try:
            exchange.collect(c, c, "ccl.all_to_all %x") if c == 0 else exchange.finish(c)
        except InterpretationError as e:
            errors.append(e)

    threads = [threading.Thread(target=chip, args=(c,)) for c in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(errors) == 2 and "chip 0: ccl.all_to_all %x; chip 1: the end of the function" in str(errors[0])


def test_collectives_wait_for_the_slowest_chip() -> None:
    sim = simulate_on_mesh(tcpc.compile_file("examples/deepseek_v3.moe"), MeshSpec.parse("ep=4"), seed=0)
    report = sim.report
    for j in {x.collective for x in report.links}:
        ends = {x.end for x in report.links if x.collective == j}
        starts = {x.start + x.wait_cycles for x in report.links if x.collective == j}
        assert len(ends) == 1 and len(starts) == 1


@pytest.mark.parametrize("example, spec", [
    ("examples/gpt_oss.moe", "ep=2,tp=2"),            # F-sized biases split, the down bias added once
    ("examples/deepseek_v3.moe", "tp=2"),             # a shared expert after the combine
    ("examples/mixtral.moe", "dp=2,ep=2,tp=2,strategy=allgather"),
])
def test_tp_within_the_stated_tolerance(example: str, spec: str) -> None:
    program = tcpc.compile_file(example)
    parsed = MeshSpec.parse(spec)
    sim = simulate_on_mesh(program, parsed, seed=1)
    results = check_on_mesh(program, parsed, sim, seed=1)
    assert all(c.ok for c in results), [c.message for c in results]
    assert len(sim.report.chips) == parsed.mesh.chips


def test_tp_regrouping_shows_within_the_allowance() -> None:
    """At F = 600 the regrouped sum over F rounds some expert outputs to the neighbouring bf16
    value: the tp run differs from the same mesh without tp (whose chips compute each sum over
    F whole) and stays within the stated tolerance of the reference."""
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims={"D": 256, "F": 600, "T": 16})
    spec = MeshSpec.parse("ep=2,tp=2")
    sim = simulate_on_mesh(program, spec, seed=1)
    whole = simulate_on_mesh(program, MeshSpec.parse("ep=2"), seed=1)
    assert not np.array_equal(sim.outputs[0], whole.outputs[0])  # the regrouping shows
    results = check_on_mesh(program, spec, sim, seed=1)
    assert all(c.ok for c in results), [c.message for c in results]


def test_tp_errors_are_clear(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "examples/toy.moe", "--mesh", "ep=2,tp=3"]) == 1
    assert "F = 16 does not divide over tp = 3 chips" in capsys.readouterr().err
    layer = CAPACITY_LAYER.replace("h = silu(grouped_matmul(xb, w_up, route))\n    return combine(grouped_matmul(h, w_down, route)",
                                   "h = silu(grouped_matmul(xb, w_up, route))\n    return combine(silu(grouped_matmul(h, w_down, route))")
    assert layer != CAPACITY_LAYER
    with pytest.raises(PassFailedException, match="must feed the combine directly"):
        simulate_on_mesh(tcpc.compile_source(layer), MeshSpec.parse("tp=2"))


def test_tp_reduction_sends_only_the_received_rows() -> None:
    """The reduce-scatter over tp carries the slots that hold rows (f32), not the static buffer:
    over the ep chips of one tp slice, the T * K = 8 pairs of the toy layer, each tp chip
    sending the other the half of their columns it sums (one ring step, half an all-reduce's).
    Each returns its half of the columns (bf16) and the tp group gathers the outputs' halves."""
    sim = simulate_on_mesh(tcpc.compile_file("examples/toy.moe"), MeshSpec.parse("ep=2,tp=2"), seed=0)
    sent = {x.chip: x.sent_bytes for x in sim.report.links if x.op == "ccl.reduce_scatter"}
    row = 8 * 4  # D = 8, f32
    assert sent[0] + sent[2] == sent[1] + sent[3] == 8 * row // 2
    assert not any(x.op == "ccl.all_reduce" for x in sim.report.links)
    gathered = {x.chip: x.sent_bytes for x in sim.report.links if x.op == "ccl.all_gather"}
    assert gathered == {c: 2 * 4 * 2 for c in range(4)}  # each chip's 2 tokens' 4 columns, bf16


def test_a_packed_all_to_all_sends_each_slice_from_where_the_last_ended() -> None:
    """`packed`: slice d's rows[d] rows follow the earlier slices' in the input; the exchange
    lays them out at the head of slice d, zeros after, as an unpacked send of the same rows."""
    from runtime_sim.semantics.ccl_semantics import unpacked

    x = np.arange(3 * 4 * 2, dtype=np.float32).reshape(3, 4, 2)
    out = unpacked(x, np.array([2, 0, 3], dtype=np.int32))
    flat = x.reshape(12, 2)
    assert np.array_equal(out[0, :2], flat[:2]) and not out[0, 2:].any()
    assert not out[1].any()
    assert np.array_equal(out[2, :3], flat[2:5]) and not out[2, 3:].any()


def test_ccl_verifier_names_the_problem() -> None:
    from xdsl.dialects.builtin import TensorType, i32
    from xdsl.ir import Block
    from xdsl.utils.exceptions import VerifyException

    block = Block(arg_types=[TensorType(i32, [4, 2]), TensorType(i32, [3, 5])])
    plan = ccl.A2APlanOp(block.args[0], "ep", 2, 8)
    assert ccl.a2a_slots(4, 2, 4) == 8 and plan.slots == 8
    plan.verify()
    with pytest.raises(VerifyException, match="do not divide over 3 chips"):
        ccl.A2APlanOp(block.args[0], "ep", 3, 8).verify()
    with pytest.raises(VerifyException, match="one slice per chip"):
        ccl.AllToAllOp(block.args[1], "ep", 2).verify()
    with pytest.raises(VerifyException, match="reductions take float tensors"):
        ccl.AllReduceOp(block.args[1], "ep", 3).verify()
    ccl.A2ATokenListsOp(plan.slot_rows, block.args[0], "ep", 2, 8, 2).verify()
    with pytest.raises(VerifyException, match=r"values i32\[3, 5\] are not \[4, 2\]"):
        ccl.A2ATokenListsOp(plan.slot_rows, block.args[1], "ep", 2, 8, 2).verify()


def test_mesh_coordinates_and_groups() -> None:
    mesh = ccl.Mesh.parse("ep=4, dp=2")
    assert str(mesh) == "dp=2,ep=4" and mesh.chips == 8
    assert mesh.coordinates(6) == {"dp": 1, "ep": 2}
    assert mesh.group(6, "ep") == [4, 5, 6, 7] and mesh.group(6, "dp") == [2, 6]
    for bad in ("ep=0", "ep=2,ep=2", "ep=x", "pp=2"):
        with pytest.raises(ccl.MeshSpecError):
            ccl.Mesh.parse(bad)


def test_benchmark_rows_stay_above_their_bound() -> None:
    from benchmark_scripts import load_script

    bench = load_script("mesh")
    model = bench.MODELS[1]
    tiny = dict(D=16, F=32, E=8, K=2)
    for chips, tp, strategy, routing, block in ((2, 1, "a2a", "balanced", None), (2, 1, "allgather", "skewed", 2),
                                                (4, 2, "a2a", "balanced", 2)):
        row = bench.mesh_row(model, chips, 4, strategy, routing, dims=tiny, tp=tp, block=block)
        assert row.total_cycles >= row.bound > 0 and 0 < row.communication_cycles < row.total_cycles
        mesh = "ep=2" + (",tp=2" if tp > 1 else "")
        assert f"| {chips} | {mesh} | 4 | {strategy} | {routing} |" in bench.table([row])
        assert row.topk in ("rank", "rounds") and sum(row.phases.values()) == row.total_cycles
        if block is None:  # chosen by cost on the mesh
            assert dict(row.tried)[row.block] == min(c for _, c in row.tried)
    choices = np.array([[0, 1], [2, 3], [0, 2], [1, 3]], dtype=np.int32)  # chips 0, 0 | 1, 1 of E = 4
    machine = load_mesh_machine()
    # chip 0: its token 1 goes to chip 1 and comes back; both tokens of chip 1 come in and their
    # results go out: 3 rows each way
    assert bench.link_bound_cycles(choices, 2, 4, 30, machine) == 3 * 30 / machine.link_bytes_per_cycle


def test_benchmark_chip_limit_is_each_chips_own_work() -> None:
    """Qwen3 at D 16, F 32, E 8 on ep=2 (chip 0: experts 0-3, chip 1: 4-7), T = 4 tokens, K = 2:
    chip 0 receives 5 pairs on experts 0, 1 and 2, chip 1 3 pairs on expert 5; each chip's
    FLOPs and minimal bytes from its own tokens, pairs and used experts."""
    from benchmark_scripts import load_script

    bench = load_script("mesh")
    dims = dict(T=4, D=16, F=32, E=8, K=2, B=2)
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims=dims)
    choices = np.array([[0, 1], [2, 5], [0, 5], [1, 5]], dtype=np.int32)
    machine = load_mesh_machine()
    limits = bench.chip_limit_cycles(program, MeshSpec.parse("ep=2"), choices, 8, machine)

    def limit(pairs: int, used: int) -> float:
        flops = 2 * 2 * 16 * 8 + pairs * 3 * 2 * 16 * 32  # its 2 tokens' router, 3 projections per pair
        hbm = 2 * 16 * 2 + 16 * 8 * 2 + used * 3 * 16 * 32 * 2 + 2 * 16 * 2  # x, router, used experts, out
        return max(flops / 256e12, hbm / 1.5e12) * machine.chip.clock_hz

    assert limits == pytest.approx([limit(5, 3), limit(3, 1)])


def test_reference_scatter_drops_pairs_routed_to_no_expert() -> None:
    from runtime_sim.semantics.moe_semantics import route_plan

    plan = route_plan(np.array([[1], [-1], [1], [0]], dtype=np.int32), moe.RouteType.make(4, 1, 2, 2))
    assert plan.scatter_idx.reshape(-1).tolist() == [2, -1, 3, 0]
    assert plan.expert_ids.tolist()[:2] == [0, 1]


def test_topk_auto_keeps_the_cheaper_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    program = tcpc.compile_file("examples/toy.moe")
    sim = simulate_on_mesh(program, MeshSpec.parse("ep=2,topk=auto"), cost_only=True)
    assert set(sim.topk_cycles) == {"rank", "rounds"}
    best = min(sim.topk_cycles, key=lambda s: (sim.topk_cycles[s], s != "rank"))
    assert sim.report.total_cycles == sim.topk_cycles[best]
    assert (f"lower-topk{{strategy={best}}}" in sim.pipeline) == (best != "rank")
    with pytest.raises(ccl.MeshSpecError, match="unknown topk 'best'"):
        MeshSpec.parse("ep=2,topk=best")
    assert main(["compile", "examples/toy.moe", "--mesh", "ep=2,topk=auto", "--emit", "lowered"]) == 1
    assert "topk=auto is chosen by simulating" in capsys.readouterr().err


class _Threads:
    """An interpreter listener that notes the threads it is called from."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def will_interpret_op(self, op: object, args: object) -> None:
        self.names.add(threading.current_thread().name)

    def did_interpret_op(self, op: object, results: object) -> None:
        pass


@pytest.mark.parametrize("cost_only", [False, True])
def test_one_progress_line_follows_every_chip(cost_only: bool) -> None:
    """`tcpc run --mesh`'s progress line: the listeners hear every chip's thread, and the total
    is every chip's ops."""
    from runtime_sim.perf.simulate import reachable_functions
    from tcpc.program import function_in
    from tcpc.progress import Progress

    program = tcpc.compile_file("examples/toy.moe")
    spec = MeshSpec.parse("ep=2")
    threads, progress = _Threads(), Progress(stream=io.StringIO(), runs=spec.mesh.chips * spec.simulations(cost_only))
    sim = simulate_on_mesh(program, spec, cost_only=cost_only, listeners=[threads, progress])
    assert threads.names == {"chip0", "chip1"}
    one_chip = Progress.count_ops(reachable_functions(sim.module, function_in(sim.module, "toy")))
    assert progress.total == 2 * one_chip and progress.done > 0
    assert [MeshSpec.parse(f"ep=2,topk={t}").simulations(c) for t in ("rank", "auto") for c in (False, True)] == [1, 1, 3, 2]


def test_mesh_report_from_each_chips_one_memory_plan(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """schedule_mesh plans each chip's memory once, places its commands once, a collective at a
    time (scheduler.Placer), and reports from that plan and schedule with the collectives' final
    cycles: the same reports, spills and streams included, as planning and scheduling each chip
    again at the end (chips of 16 KB SRAM, 8 KB a cluster: the compiler tiles for it, and
    the ops too large for a cluster's still stream)."""
    import runtime_sim.perf.mesh_simulate as mesh_simulate

    (tmp_path / "chip.toml").write_text('extends = "rngd"\nname = "small-sram"\n[sram]\n'
                                        'bytes_per_slice = { value = 32, assumption = "tiny, to spill" }\n')
    (tmp_path / "mesh.toml").write_text('extends = "rngd_pcie"\nchip = "chip.toml"\n')
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims={"T": 64})

    def report() -> dict:
        sim = simulate_on_mesh(program, MeshSpec.parse("ep=2"), cost_only=True, machine=tmp_path / "mesh.toml",
                               routing="skewed", seed=1)
        return sim.report.to_json()

    once = report()
    assert all(chip["streams"] for chip in once["chips"])
    from runtime_sim.perf.cost_model import LINK
    from runtime_sim.perf.simulate import simulate_trace

    monkeypatch.setattr(mesh_simulate, "trace_report",
                        lambda trace, machine, policy, plan, sched, work:
                        simulate_trace(trace, machine, policy, {LINK: 1}, work=work)[0])
    assert report() == once


def test_benchmark_default_plan_covers_the_issue() -> None:
    """Issue #15's benchmark: DeepSeek-V3 on 8, 16 and 32 chips and Qwen3 on 2, 4 and 8, decode
    up to T = 128 per chip and prefill (4096 per chip) for each model, a2a against allgather,
    balanced against skewed; every row of the default plan a distinct run."""
    from benchmark_scripts import load_script

    bench = load_script("mesh")
    plan = bench.runs(quick=False)
    keys = [(m.name, *rest[:-1]) for m, *rest in plan]
    assert len(set(keys)) == len(keys)
    deepseek, qwen = bench.MODELS
    a2a = {(m.name, chips) for m, chips, _, s, r, tp, _ in plan if (s, r, tp) == ("a2a", "balanced", 1)}
    assert {(deepseek.name, c) for c in (8, 16, 32)} | {(qwen.name, c) for c in (2, 4, 8)} <= a2a
    assert {t for _, _, t, *_ in plan} == {*bench.DECODE, bench.PREFILL}
    prefill = {(m.name, s) for m, _, t, s, *_ in plan if t == bench.PREFILL}
    assert prefill == {(m.name, s) for m in bench.MODELS for s in ("a2a", "a2a_sum", "allgather")}
    assert {(s, r) for _, _, _, s, r, *_ in plan} == {("a2a", "balanced"), ("a2a", "skewed"), ("allgather", "balanced"),
                                                       ("a2a_sum", "balanced")}
    assert all(block is None for *_, block in plan)  # every row's block chosen by cost on the mesh


@pytest.mark.parametrize("strategy", ["a2a", "a2a_sum"])
def test_receivers_skip_combine_tiles_without_pairs(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver's combine runs over its static worst-case buffer in token tiles (small tiles
    here); a tile none of whose rows holds a pair is skipped by a guard, and the outputs stay
    the reference's. allgather's combine (the group's real tokens) has no such guard."""

    from tcpc import pipelines

    tiled = tuple("schedule-tokens{tile_bytes=4096}" if p == "schedule-tokens" else p for p in pipelines.FULL_PIPELINE)
    monkeypatch.setitem(pipelines.LEVELS, "scheduled", tiled)
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims={"T": 32, "D": 64, "F": 32, "E": 8, "K": 2, "B": 4})
    spec = MeshSpec.parse(f"ep=4,strategy={strategy}")
    chip = program.lower(spec.pipeline())
    assert "tile_has_pairs" in str(chip)
    sim = simulate_on_mesh(program, spec, seed=2)
    results = check_on_mesh(program, spec, sim, seed=2)
    assert all(c.ok for c in results), [c.message for c in results]
    if strategy == "a2a":
        assert all(c.identical for c in results)
    combine = [o for c in sim.report.chips for o in c.ops if o.phase == "combine"]
    # Every guarded tile that runs gathers its rows (the receiver's combine of the tokens it
    # received, its `y_restored`): fewer such gathers than guards means tiles were skipped.
    restored = [o for o in combine if o.name == "tcp.dma_gather" and o.label.startswith("%y_restored")]
    assert restored
    assert len(restored) < [o.name for o in combine].count("tile.guard")


def test_a2a_skips_the_split_pairs_gather_when_no_token_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """a2a's receiver gathers a split token's pairs from the blocks into a worst-case buffer,
    a slice per sender, in tiles guarded like the combine's: a sender none of whose tokens it
    split is skipped (the zero-filled buffer is what a gather of -1 rows makes). The home chip
    gathers and sums the pairs that came back only in a tile that holds one (else the sum is
    +0.0, beside the receivers' sums of whole tokens). Under the seed's routing some tokens
    split and the outputs are one chip's bit for bit; under balanced routing (a token's 2
    experts on one chip) neither gather runs."""

    from tcpc import pipelines

    tiled = tuple("schedule-tokens{tile_bytes=4096}" if p == "schedule-tokens" else p for p in pipelines.FULL_PIPELINE)
    monkeypatch.setitem(pipelines.LEVELS, "scheduled", tiled)
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims={"T": 32, "D": 64, "F": 32, "E": 8, "K": 2, "B": 4})
    spec = MeshSpec.parse("ep=4,strategy=a2a")
    sim = simulate_on_mesh(program, spec, seed=2)
    results = check_on_mesh(program, spec, sim, seed=2)
    assert all(c.identical for c in results), [c.message for c in results]

    assert "tile_has_split_pairs" in str(program.lower(spec.pipeline()))

    def gathers(report, label: str) -> int:
        return sum(1 for c in report.chips for o in c.ops if o.name == "tcp.dma_gather" and o.label.startswith(label))

    assert gathers(sim.report, "%split_rows") > 0 and gathers(sim.report, "%pair_rows") > 0
    balanced = simulate_on_mesh(program, spec, seed=2, cost_only=True, routing="balanced")
    assert gathers(balanced.report, "%split_rows") == 0 and gathers(balanced.report, "%pair_rows") == 0


def test_a2a_split_pairs_gather_is_never_packed_as_received_rows() -> None:
    """a2a's split pairs gathered to go home are guarded by their own indices ([chips, slots]);
    on 32 chips at 2 tokens a chunk their slice per sender is narrower than the tile, which
    once sent them through the receiver's packing of [tokens, pairs] indices: a ve.filter of
    [32, 16] values by [512, 16] tags, an IR that did not verify."""
    program = tcpc.compile_file("examples/deepseek_v3.moe",
                                dims=dict(T=512, D=64, F=32, FS=32, E=256, K=8, NG=8, TG=4, B=16))
    lowered = str(program.lower(MeshSpec.parse("ep=32,strategy=a2a,chunks=8").pipeline()))
    assert "split_rows" in lowered and "split_at_packed" not in lowered


def test_a2a_home_guard_when_its_pair_sum_leaves_the_loop() -> None:
    """DeepSeek-V3's layer adds its shared expert after the routed sum; at D = 7168 and 16
    tokens a chip the home chip's token loop (tiles of 8 rows) stores its pair sum for the add
    that follows it, so the tile's store reads the guarded sum, not the one inside the branch
    (an interpreter KeyError before)."""
    dims = dict(T=128, D=7168, F=64, FS=64, E=256, K=8, NG=8, TG=4, B=4)
    program = tcpc.compile_file("examples/deepseek_v3.moe", dims=dims)
    spec = MeshSpec.parse("ep=8,strategy=a2a")
    assert "tile_has_split_pairs" in str(program.lower(spec.pipeline()))
    report = simulate_on_mesh(program, spec, cost_only=True, routing="balanced").report
    assert report.total_cycles > 0


@pytest.mark.parametrize("strategy", ["a2a", "a2a_sum"])
def test_receivers_combine_the_rows_they_received_packed_first(strategy: str) -> None:
    """With 8 senders a receiver's buffers are mostly padding, a few rows at the head of every
    slice (balanced decode routing: one token of each sender's 2 here): its combine packs the
    rows it received first (`packed_rows`, a ve.filter) and runs in tiles of a slice's rows
    (2 here, under a flit's 8), so one tile runs and the others are skipped (cost-only,
    balanced), and its sums go back as they are, the senders' rows one after another (a
    packed all-to-all): the reference's bits for a2a (the seed's routing)."""
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims={"T": 16, "D": 64, "F": 32, "E": 16, "K": 2, "B": 2})
    spec = MeshSpec.parse(f"ep=8,strategy={strategy}")
    chip = str(program.lower(spec.pipeline()))
    assert "%packed_rows = ve.filter" in chip and "packed}" in chip and "%token_sums = tcp.dma_scatter" not in chip
    sim = simulate_on_mesh(program, spec, seed=2)
    results = check_on_mesh(program, spec, sim, seed=2)
    assert all(c.ok for c in results), [c.message for c in results]
    if strategy == "a2a":
        assert all(c.identical for c in results)
    balanced = simulate_on_mesh(program, spec, seed=2, cost_only=True, routing="balanced")
    for chip in balanced.report.chips:
        combine = [o for o in chip.ops if o.phase == "combine"]
        restored = [o for o in combine if o.name == "tcp.dma_gather" and o.label.startswith("%y_restored")]
        assert len(restored) == 1 and [o.name for o in combine].count("tile.guard") == 8  # 8 tiles, one runs
    gathered = program.lower(MeshSpec.parse("ep=4,strategy=allgather").pipeline())
    assert "tile_has_pairs" not in str(gathered)


def test_deepseek_prefill_chips_need_no_spill_or_stream() -> None:
    """DeepSeek-V3 on ep=8 at 4096 tokens per chip: the home chip's combine of its tokens'
    returned rows is tiled too (schedule-tokens' second token count), not one gather of
    470 MB (a2a) or 470 MB (a2a_sum, a bf16 row per token and chip) that the memory plan would
    stream."""
    dims = dict(T=32768, D=7168, F=2048, FS=2048, E=256, K=8, NG=8, TG=4, B=1024)
    program = tcpc.compile_file("examples/deepseek_v3.moe", dims=dims)
    report = simulate_on_mesh(program, MeshSpec.parse("ep=8,strategy=a2a_sum,topk=rounds"), cost_only=True,
                              routing="balanced", seed=1, machine=load_mesh_machine()).report
    assert {(len(c.spills), len(c.streams)) for c in report.chips} == {(0, 0)}


@pytest.mark.parametrize("strategy", ["a2a", "a2a_sum", "allgather"])
def test_prefill_chip_programs_need_no_spill_or_stream(strategy: str) -> None:
    """Issue #12's rule on a mesh: the compiler places every value (a chip's program never
    needs the memory plan to spill or stream). Qwen3-30B-A3B on ep=2 at 4096 tokens per chip,
    real dims: a2a's worst-case buffers (268 MB) go to HBM, allgather's combine gathers the
    bf16 rows (not one f32 copy of them all)."""
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims=dict(T=8192, D=2048, F=768, E=128, K=8, B=512))
    spec = MeshSpec.parse(f"ep=2,strategy={strategy},topk=rounds")
    report = simulate_on_mesh(program, spec, cost_only=True, routing="balanced", seed=1,
                              machine=load_mesh_machine()).report
    assert [(len(c.spills), len(c.streams)) for c in report.chips] == [(0, 0), (0, 0)]


@pytest.mark.parametrize("example, spec", [
    ("examples/toy.moe", "ep=2,chunks=2"),
    ("examples/qwen3_moe.moe", "dp=2,ep=2,chunks=2"),
    ("examples/deepseek_v3.moe", "ep=4,chunks=4"),   # a shared expert after the chunks' output
    ("examples/gpt_oss.moe", "ep=2,tp=2,chunks=2"),  # tp's partial sums per chunk
])
def test_chunked_dispatch_is_bit_identical_to_one_chip(example: str, spec: str) -> None:
    """The token loop in chunks (shard-experts' `chunks`, software-pipelined): every chunk's
    pairs reach the same blocks in the same order as one chip's, so a2a stays bit-identical."""
    results, sim = _checked(tcpc.compile_file(example), spec)
    assert all(c.identical for c in results), [c.message for c in results]
    chunks = int(spec.rsplit("chunks=", 1)[1])
    # a2a's two returns, a row per token received and the split tokens' pairs; with tp, every pair's row
    names = ("%returned =",) if "tp=" in spec else ("%returned_sums =", "%returned =")
    for name in names:
        assert len([x for x in sim.report.links if x.chip == 0 and x.label.startswith(name)]) == chunks


def test_chunked_a2a_sum_within_tolerance() -> None:
    program = tcpc.compile_file("examples/deepseek_v3.moe")
    spec = MeshSpec.parse("ep=4,strategy=a2a_sum,chunks=2")
    results = check_on_mesh(program, spec, simulate_on_mesh(program, spec, seed=1), seed=1)
    assert all(c.ok for c in results), [c.message for c in results]


def test_chunked_router_is_tiled_at_the_chips_tokens() -> None:
    """A chip whose token loop is in chunks gathers a chunk's tokens at home, yet its router is
    a token loop at the chip's own tokens (schedule-tokens' token_counts), and the chunks' rows
    of the tokens are read by the dispatch's DMA from HBM (load-arguments). Before, that router
    stayed whole (DeepSeek-V3 ep=8 at 4,096 tokens a chip, 2 chunks: 15,780 us, not 16,712)."""
    program = tcpc.compile_file("examples/deepseek_v3.moe", dims={"T": 2048, "E": 256, "K": 8, "NG": 8, "TG": 4,
                                                                  "B": 16})
    report = simulate_on_mesh(program, MeshSpec.parse("ep=8,chunks=2"), cost_only=True).report
    assert [t.describe() for t in report.loops if t.phase == "router"] == [
        "router loop %row: 16 x step 16; tiles f32[8, 256]"]
    # 216,273 with the router whole; 118,383 before a2a's split pairs returned first; 117,793 before
    # a chip with none to return skipped their all-to-all and the receivers' gathers took 2-row tiles;
    # 117,239 before the router's widened tokens were one bf16 piece (three piece pairs, not nine); 116,855
    # before the plans' cumsums were chunked as lower-routing's (ccl_cost.chunked_cumsum_cycles); 114,588 before
    # the pinned routing waited for the router's top-k (`tcp.order`), whose indices' stores and cross-cluster
    # copies cost-only runs had dropped
    assert report.total_cycles == 115_091


def test_a_chunks_home_sum_in_tiles_is_stored_where_the_output_holds_it() -> None:
    """A chunked chip's home sum tiled (schedule-tokens at 96 KB tiles, which would hold 32 of
    a chunk's 128 rows; at real dims SRAM's budget tiles it): each chunk's loop stores its tiles
    into the layer's output past the chunk's offset, not into a buffer of its own that a
    `tile.store` copied into the output after the loop, and the last chunk's, after the last
    return, in a tile per DMA engine (8 of 16 rows). Every chip's outputs keep their bits
    against the home sums made whole."""
    from xdsl.dialects import arith, func, scf
    from runtime_sim.perf.mesh_simulate import simulate_mesh
    from tcpc.arrays import prepare_inputs
    from tcpc.mesh_run import split_arguments, token_outputs
    program = tcpc.compile_file("examples/qwen3_moe.moe", dims={"T": 512, "E": 8, "K": 2, "B": 16})
    spec = MeshSpec.parse("ep=2,chunks=2")
    whole = spec.pipeline()
    tiled = whole.replace("schedule-tokens,", "schedule-tokens{tile_bytes=98304},")
    name = program.function(None).sym_name.data
    args = prepare_inputs(program.function(None), {}, 3)
    outputs = []
    for pipeline in (whole, tiled):
        module = program.lower(pipeline)
        outputs.append(token_outputs(spec.mesh, simulate_mesh(module, name, load_mesh_machine(), split_arguments(
            module, name, spec.mesh, args)).outputs))
    body = next(op for op in module.walk() if isinstance(op, func.FuncOp)).body.block
    homes = [op for op in body.ops if isinstance(op, scf.ForOp)
             and any(isinstance(o, arith.AddiOp) and o.rhs.name_hint and o.rhs.name_hint.startswith("chunk")
                     for o in op.body.block.ops)]
    assert [(h.ub.owner.value.value.data, h.step.owner.value.value.data) for h in homes] == [(128, 32), (128, 16)]
    assert not any(isinstance(op, tile.StoreOp) and isinstance(op.tile.owner, scf.ForOp) for op in body.ops)
    for before, after in zip(*outputs):
        assert np.array_equal(before.view(np.uint8), after.view(np.uint8))


def test_chunk_count_is_chosen_by_cycles_and_reported() -> None:
    """chunks=auto simulates every count that divides the chip's tokens and keeps the fewest
    cycles; the mesh report and its JSON say so, with every count's cycles."""
    program = tcpc.compile_file("examples/toy.moe", dims={"T": 8})
    sim = simulate_on_mesh(program, MeshSpec.parse("ep=2,chunks=auto"), cost_only=True)
    choice = next(c for c in sim.report.choices if c.what == "chunk count")
    assert [c for c, _ in choice.alternatives] == [1, 2, 4]  # 4 tokens per chip: 8 does not divide them
    assert choice.chosen == min(choice.alternatives, key=lambda a: (a[1], a[0]))[0]
    assert sim.report.total_cycles == dict(choice.alternatives)[choice.chosen]
    assert "chose chunk count" in sim.report.to_text()
    assert sim.report.to_json()["choices"][-1]["what"] == "chunk count"
    assert all(c.choices[-1].what == "chunk count" for c in sim.report.chips)


def test_link_runs_under_the_chips_engines() -> None:
    """The link is an engine of its own: with two chunks, chunk 1's dispatch all-to-all moves
    while the tensor unit works on chunk 0 (an all-to-all's start and done are two commands,
    and only what reads the done waits)."""
    program = tcpc.compile_file("examples/toy.moe", dims={"T": 8})
    report = simulate_on_mesh(program, MeshSpec.parse("ep=2,chunks=2"), cost_only=True).report.chips[0]
    link = [o for o in report.ops if o.engine == "link" and o.cycles]
    tensor = [o for o in report.ops if o.engine == "tensor" and o.cycles]
    assert any(t.start < x.end and x.start < t.end for x in link for t in tensor)
    # Per chunk: the tokens' expert and weight lists, the rows, the return plan (the split
    # pairs' places, the token and pair counts) and the two returns.
    assert [o.name for o in report.ops if o.name.startswith("ccl.all_to_all")].count("ccl.all_to_all_done") == 16
