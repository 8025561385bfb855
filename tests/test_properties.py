"""Property tests of the moe ops against the independent loop implementation in test_reference.py.

Small graphs are built with `tcpc.compile_source` over random dims and routings and run on the
reference; every moe op's results are compared (routing exactly, values within test_reference's
ULPS). Edge cases that real MoE systems hit
(docs/models.md#edge-cases-the-examples-and-tests-cover) are pinned as explicit examples: all
pairs on one expert, empty experts, ties, NaN and +-inf scores, +-0.0, K = E, K = 1, T = 1,
T*K not a multiple of B, capacity drops, order="index". A brute force checks that
`dialects.moe.max_blocks` is the exact worst case over all routings.
"""

from __future__ import annotations

import itertools
import math
from functools import cache

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_reference import BF16, F32, Layout, Oracle, assert_close, assert_same_route, run_tapped
from test_reference import topk as oracle_topk
from xdsl.dialects import func
from xdsl.dialects.builtin import FunctionType, ModuleOp, TensorType, f32
from xdsl.ir import Block, Region
from xdsl.parser import Parser
from xdsl.printer import Printer
from xdsl.utils.exceptions import InterpretationError

import tcpc
from dialects import tmath
from dialects.moe import max_blocks
from tcpc.pipelines import make_context

DTYPES = {"bf16": BF16, "f32": F32, "i32": np.dtype(np.int32)}
SPECIAL_SCORES = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 0.5, 3.0]
"""Few distinct values, so rows are full of ties, NaNs, infinities and signed zeros."""


@cache
def compiled(source: str) -> tcpc.Program:
    return tcpc.compile_source(source)


def shape_text(shape: tuple[int, ...]) -> str:
    return ", ".join(map(str, shape))


# --- top-k -----------------------------------------------------------------------------------


@st.composite
def topk_cases(draw):
    dtype = draw(st.sampled_from(["bf16", "f32", "i32"]))
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    e = draw(st.integers(1, 8))
    k = draw(st.integers(1, e))
    order = draw(st.sampled_from(["score", "index"]))
    n = math.prod(lead) * e
    if dtype == "i32":
        element = st.sampled_from([-(2**31), 2**31 - 1, 0]) | st.integers(-3, 3)
    else:
        element = st.sampled_from(SPECIAL_SCORES) | st.floats(width=32)
    values = draw(st.lists(element, min_size=n, max_size=n))
    return dict(dtype=dtype, shape=(*lead, e), k=k, order=order, values=values)


def run_topk(case) -> None:
    dtype, shape, k, order = case["dtype"], case["shape"], case["k"], case["order"]
    with np.errstate(all="ignore"):  # f32 values beyond bf16's range round to inf
        scores = np.array(case["values"], dtype=np.float64 if dtype != "i32" else np.int64)
        scores = scores.astype(np.float32 if dtype != "i32" else np.int32).astype(DTYPES[dtype]).reshape(shape)
    out_shape = shape_text((*shape[:-1], k))
    program = compiled(
        f"graph g(s: {dtype}[{shape_text(shape)}]) -> ({dtype}[{out_shape}], i32[{out_shape}]) {{\n"
        f'    v, i = topk(s, {k}, order="{order}")\n'
        "    return v, i\n}\n"
    )
    values, indices = program.run({"s": scores}).outputs
    want_values, want_indices = oracle_topk(scores, k, order)
    np.testing.assert_array_equal(indices, want_indices)
    assert values.dtype == scores.dtype
    assert values.tobytes() == want_values.tobytes(), "values are not the chosen elements, bit for bit"
    rows = indices.reshape(-1, k)
    assert all(len(set(r)) == k for r in rows.tolist()), "the K indices of a row must be distinct"
    if order == "index":
        assert (np.diff(rows, axis=-1) > 0).all()


def _topk_example(dtype: str, values: list, k: int, order: str = "score", lead: tuple[int, ...] = (1,)):
    e = len(values) // math.prod(lead)
    return dict(dtype=dtype, shape=(*lead, e), k=k, order=order, values=values)


@settings(max_examples=200, deadline=None)
@given(topk_cases())
@example(_topk_example("bf16", [math.nan] * 4, 4))  # all NaN: still K distinct, by lower index
@example(_topk_example("f32", [math.nan, 1.0, math.nan, -math.inf], 3))  # numbers (even -inf) before NaN
@example(_topk_example("f32", [-0.0, 0.0, -0.0, 0.0], 2))  # -0.0 == +0.0: lower index wins
@example(_topk_example("bf16", [math.inf, 1.0, math.inf, -math.inf, math.nan], 5, "index"))  # K = E
@example(_topk_example("bf16", [1.0, 1.00390625, 1.0, 1.00390625], 2))  # f32 values that tie in bf16
@example(_topk_example("f32", [1.0, 1.0000001, 1.0], 1))  # f32 is ranked exactly, not rounded to bf16
@example(_topk_example("i32", [-(2**31), 2**31 - 1, 0, 2**31 - 1], 2))
@example(_topk_example("f32", [0.5, 0.25, 0.5, 0.75, 0.25, 0.5], 2, "index", lead=(2,)))
def test_topk_matches_selection_loop(case) -> None:
    run_topk(case)


# --- scatter, grouped_matmul, combine --------------------------------------------------------


@st.composite
def routing_cases(draw):
    """Dims, a capacity, a block size that fits, and a routing: from topk of drawn scores (with
    ties, NaN and infinities), uniformly random, the same for every token, or one expert only."""
    t = draw(st.integers(1, 6))
    e = draw(st.integers(1, 6))
    mode = draw(st.sampled_from(["scores", "random", "same", "one_expert"]))
    k = 1 if mode == "one_expert" else draw(st.integers(1, e))
    capacity = draw(st.none() | st.integers(1, t + 1))
    block = draw(st.integers(1, min(t, capacity or t)))
    case = dict(
        T=t, E=e, K=k, D=draw(st.integers(1, 3)), F=draw(st.integers(1, 3)), B=block, C=capacity,
        mode=mode, order=draw(st.sampled_from(["score", "index"])),
        x=draw(st.sampled_from(["bf16", "f32"])), w=draw(st.sampled_from(["bf16", "f32"])),
        bias=draw(st.sampled_from([None, "bf16", "f32"])),
        weights=draw(st.sampled_from([None, "bf16", "f32", "scores"])),
        nan_weights=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )
    if mode == "scores":
        case["scores"] = draw(st.sampled_from(["bf16", "f32"]))
        case["values"] = draw(st.lists(st.sampled_from(SPECIAL_SCORES), min_size=t * e, max_size=t * e))
    elif mode == "random":
        case["choices"] = [draw(st.permutations(range(e)))[:k] for _ in range(t)]
    elif mode == "same":
        case["choices"] = [list(draw(st.permutations(range(e)))[:k])] * t
    else:
        case["choices"] = [[draw(st.integers(0, e - 1))]] * t
    if case["weights"] == "scores" and mode != "scores":
        case["weights"] = "f32"
    return case


def routing_source(c) -> tuple[str, list[str]]:
    """The graph for a case, and the names of its inputs in order."""
    t, k, e, d, f, b = c["T"], c["K"], c["E"], c["D"], c["F"], c["B"]
    out = "bf16" if c["x"] == c["w"] == "bf16" else "f32"
    params = [f"x: {c['x']}[{t}, {d}]", f"w: {c['w']}[{e}, {d}, {f}]"]
    names = ["x", "w"]
    lines = []
    if c["mode"] == "scores":
        params.append(f"s: {c['scores']}[{t}, {e}]")
        names.append("s")
        lines.append(f'top_v, idx = topk(s, {k}, order="{c["order"]}")')
    else:
        params.append(f"idx: i32[{t}, {k}]")
        names.append("idx")
    capacity = "" if c["C"] is None else f", capacity={c['C']}"
    lines.append(f"xb, route = scatter(x, idx, experts={e}, block={b}{capacity})")
    bias = ""
    if c["bias"] is not None:
        params.append(f"bias: {c['bias']}[{e}, {f}]")
        names.append("bias")
        bias = ", bias=bias"
    lines.append(f"y = grouped_matmul(xb, w, route{bias})")
    weights = ""
    if c["weights"] == "scores":
        weights = ", top_v"
    elif c["weights"] is not None:
        params.append(f"wt: {c['weights']}[{t}, {k}]")
        names.append("wt")
        weights = ", wt"
    lines.append(f"return combine(y, route{weights})")
    body = "".join(f"    {line}\n" for line in lines)
    return f"graph g({', '.join(params)}) -> {out}[{t}, {f}] {{\n{body}}}\n", names


def routing_inputs(c, names: list[str]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(c["seed"])
    t, k, e, d, f = c["T"], c["K"], c["E"], c["D"], c["F"]

    def floats(shape, dtype):
        return rng.standard_normal(shape).astype(np.float32).astype(DTYPES[dtype])

    inputs = {"x": floats((t, d), c["x"]), "w": floats((e, d, f), c["w"])}
    if "s" in names:
        inputs["s"] = np.array(c["values"], dtype=np.float32).astype(DTYPES[c["scores"]]).reshape(t, e)
    if "idx" in names:
        inputs["idx"] = np.array(c["choices"], dtype=np.int32).reshape(t, k)
    if "bias" in names:
        inputs["bias"] = floats((e, f), c["bias"])
    if "wt" in names:
        wt = rng.standard_normal((t, k)).astype(np.float32)
        if c["nan_weights"]:  # a dropped pair must add nothing, even with a NaN or inf weight
            wt[rng.random((t, k)) < 0.3] = np.nan
            wt[rng.random((t, k)) < 0.2] = np.inf
        inputs["wt"] = wt.astype(DTYPES[c["weights"]])
    return inputs


def run_routing(c) -> None:
    source, names = routing_source(c)
    program = compiled(source)
    inputs = routing_inputs(c, names)
    taps = run_tapped(program, inputs)
    (out,) = program.run(inputs).outputs

    o = Oracle()
    with np.errstate(all="ignore"):
        if c["mode"] == "scores":
            top_v, idx = o.topk(inputs["s"], c["K"], c["order"])
        else:
            idx = inputs["idx"]
        xb, layout = o.scatter(inputs["x"], idx, c["E"], c["B"], c["C"])
        y = o.grouped_matmul(xb, inputs["w"], layout, inputs.get("bias"))
        weights = top_v if c["weights"] == "scores" else inputs.get("wt")
        want = o.combine(y, layout, weights)

    assert len(taps) == len(o.taps)
    for got, (what, expected) in zip(taps, o.taps):
        if isinstance(expected, Layout):
            assert_same_route(got, expected, what)
        else:
            assert_close(got, expected, what)
    assert_close(out, want, "output")

    # Layout invariants, stated directly.
    rows = layout.scatter_idx
    kept = rows[rows >= 0]
    assert len(set(kept.tolist())) == kept.size, "two pairs share a row"
    g = max_blocks(c["T"], c["K"], c["E"], c["B"], c["C"])
    used = [x for x in layout.expert_of_block if x >= 0]
    assert used == sorted(used) and layout.expert_of_block[len(used):] == [-1] * (g - len(used))
    kept_per_expert = np.bincount([layout.expert_of_block[r // c["B"]] for r in kept.tolist()], minlength=c["E"])
    assert (kept_per_expert <= min(c["T"], c["C"] or c["T"])).all()
    if c["C"] is None:
        assert kept.size == c["T"] * c["K"], "without a capacity no pair is dropped"
    # Padding rows and unused blocks are zero (no bias, no NaN leaking).
    valid = np.array(layout.valid).reshape(g, c["B"])
    assert (y.astype(np.float32)[~valid] == 0).all()


def _routing_example(T, E, K, B, C=None, choices=None, mode="random", **kw):
    case = dict(T=T, E=E, K=K, D=2, F=3, B=B, C=C, mode=mode, order="score", x="bf16", w="bf16",
                bias="f32", weights="f32", nan_weights=True, seed=1)
    if choices is not None:
        case["choices"] = choices
    case.update(kw)
    return case


@settings(max_examples=150, deadline=None)
@given(routing_cases())
# Every pair on one expert (router collapse), the other experts empty, with drops past C = 3.
@example(_routing_example(5, 4, 1, 2, C=3, choices=[[2]] * 5, mode="one_expert"))
# All tokens on the same K experts; T*K = 6 is not a multiple of B = 4.
@example(_routing_example(4, 5, 2, 4, choices=[[4, 1]] * 3 + [[1, 4]]))
# K = E: every expert gets every token.
@example(_routing_example(3, 3, 3, 2, choices=[[0, 1, 2], [2, 1, 0], [1, 0, 2]]))
# T = 1, K = 1, B = 1.
@example(_routing_example(1, 4, 1, 1, choices=[[3]]))
# Capacity 1: each expert keeps its first pair in token-major order.
@example(_routing_example(4, 3, 2, 1, C=1, choices=[[0, 1], [1, 0], [2, 0], [1, 2]]))
# Routing by topk of tied, NaN and infinite bf16 scores, in index order, weighted by the top values.
@example(_routing_example(3, 4, 2, 2, mode="scores", scores="bf16", order="index", weights="scores",
                          values=[1.0, 1.0, math.nan, -0.0, math.nan, math.nan, math.nan, math.nan,
                                  -math.inf, 0.0, -0.0, math.inf]))
# f32 blocks, so the combine's f32 sum over k in order 0..K-1 is visible in the result.
@example(_routing_example(2, 4, 4, 2, choices=[[3, 2, 1, 0], [0, 1, 2, 3]], x="f32", w="f32",
                          weights=None))
def test_scatter_grouped_matmul_combine(case) -> None:
    run_routing(case)


def test_combine_sums_in_pair_order() -> None:
    """Sum over k in order 0..K-1 in f32: (1e8 + 1) - 1e8 differs from (1e8 - 1e8) + 1. The
    blocks come from an identity-like expert: x = 1 times a 1x1 weight per expert."""
    program = compiled(
        "graph g(x: f32[1, 1], idx: i32[1, 3], w: f32[3, 1, 1]) -> f32[1, 1] {\n"
        "    xb, route = scatter(x, idx, experts=3, block=1)\n"
        "    return combine(grouped_matmul(xb, w, route), route)\n}\n"
    )
    x = np.ones((1, 1), np.float32)
    w = np.array([1e8, 1.0, -1e8], np.float32).reshape(3, 1, 1)
    for choices, want in (([0, 1, 2], 0.0), ([0, 2, 1], 1.0), ([1, 0, 2], 0.0)):
        (out,) = program.run({"x": x, "idx": np.array([choices], np.int32), "w": w}).outputs
        assert out[0, 0] == want, (choices, out)
        o = Oracle()
        xb, layout = o.scatter(x, np.array([choices], np.int32), 3, 1)
        assert o.combine(o.grouped_matmul(xb, w, layout), layout)[0, 0] == want


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_scatter_rejects_a_repeated_expert(data) -> None:
    """A token that picks one expert twice is an execution error, never a silent overflow of
    the G blocks (G is the worst case over routings with K distinct experts per token)."""
    t = data.draw(st.integers(1, 4))
    e = data.draw(st.integers(2, 5))
    k = data.draw(st.integers(2, e))
    b = data.draw(st.integers(1, t))
    choices = [list(data.draw(st.permutations(range(e)))[:k]) for _ in range(t)]
    bad = data.draw(st.integers(0, t - 1))
    i, j = data.draw(st.lists(st.integers(0, k - 1), min_size=2, max_size=2, unique=True))
    choices[bad][j] = choices[bad][i]
    program = compiled(
        f"graph g(x: f32[{t}, 2], idx: i32[{t}, {k}]) -> f32[{t}, 2] {{\n"
        f"    xb, route = scatter(x, idx, experts={e}, block={b})\n"
        "    return combine(xb, route)\n}\n"
    )
    with pytest.raises(InterpretationError, match=f"token {bad} chooses expert {choices[bad][i]} more than once"):
        program.run({"idx": np.array(choices, np.int32)})


# --- the worst-case block count ---------------------------------------------------------------


@cache
def reachable_counts(tokens: int, k: int, experts: int) -> frozenset[tuple[int, ...]]:
    """Every per-expert pair count that some routing produces (each token picks k distinct
    experts): the set after adding one token's choice at a time."""
    choices = list(itertools.combinations(range(experts), k))
    counts = {(0,) * experts}
    for _ in range(tokens):
        counts = {tuple(c + (i in pick) for i, c in enumerate(cnt)) for cnt in counts for pick in choices}
    return frozenset(counts)


def blocks_needed(counts: tuple[int, ...], block: int, capacity: int | None) -> int:
    return sum(-(-min(c, capacity if capacity is not None else c) // block) for c in counts)


def test_max_blocks_by_brute_force() -> None:
    """max_blocks is the maximum over every routing of sum_e ceil(kept_e / B): no routing needs
    more, and some routing needs exactly that many; with and without a capacity."""
    checked = 0
    for tokens in range(1, 6):
        for experts in range(1, 6):
            for k in range(1, experts + 1):
                counts = reachable_counts(tokens, k, experts)
                for block in range(1, tokens + 2):
                    for capacity in [None, *range(1, tokens + 2)]:
                        worst = max(blocks_needed(c, block, capacity) for c in counts)
                        assert max_blocks(tokens, k, experts, block, capacity) == worst, (
                            f"T={tokens} K={k} E={experts} B={block} C={capacity}: "
                            f"max_blocks gives {max_blocks(tokens, k, experts, block, capacity)}, "
                            f"the worst routing needs {worst}"
                        )
                        checked += 1
    assert checked > 1000


def test_reachable_counts_enumerate_every_routing() -> None:
    """The count sets above equal those of a literal enumeration of all routings (small sizes)."""
    for tokens, k, experts in [(1, 1, 1), (2, 1, 3), (3, 2, 3), (3, 2, 4), (4, 1, 3), (2, 3, 4)]:
        literal = set()
        for routing in itertools.product(itertools.combinations(range(experts), k), repeat=tokens):
            literal.add(tuple(sum(e in pick for pick in routing) for e in range(experts)))
        assert literal == reachable_counts(tokens, k, experts)


# --- tmath.constant prints literals that parse back -------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
@example(1e-20)
@example(-0.0)
@example(1e300)
@example(5e-324)
def test_constant_round_trips_through_custom_format(value: float) -> None:
    t = TensorType(f32, [])
    c = tmath.ConstantOp(value, t)
    fn = func.FuncOp("f", FunctionType.from_lists([], [t]), Region(Block([c, func.ReturnOp(c.result)])))
    module = ModuleOp([fn])
    text = []

    class Sink:
        def write(self, s: str) -> None:
            text.append(s)

    Printer(stream=Sink()).print_op(module)
    parsed = Parser(make_context(), "".join(text)).parse_module()
    (back,) = [op for op in parsed.walk() if isinstance(op, tmath.ConstantOp)]
    got = back.value.value.data
    if math.isnan(value):
        assert math.isnan(got)
    else:
        assert got == value and math.copysign(1, got) == math.copysign(1, value), ("".join(text), got)
