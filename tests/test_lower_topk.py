"""lower-topk is checked by translation validation: the IR before and after the pass, run on
the same inputs, gives bit-identical values and indices, for both strategies, both orders and
every score type, on adversarial scores (ties, +-0, +-inf, NaN payloads, subnormals, equal rows)."""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from xdsl.dialects.builtin import ModuleOp
from xdsl.parser import Parser

import tcpc
from dialects import moe, ve
from passes.lowering.lower_topk import DEFAULT_STRATEGY, STRATEGIES, LowerTopKPass
from runtime_sim.semantics.executor import run_function
from tcpc.cli import main as tcpc_main
from tcpc.pipelines import PASSES, apply_pipeline, make_context, parse_pipeline
from support import bits

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.moe"))
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"bf16": BF16, "f32": np.dtype(np.float32), "i32": np.dtype(np.int32)}


def topk_module(shape: tuple[int, ...], k: int, dtype: str, order: str = "score") -> ModuleOp:
    s = "x".join(map(str, shape))
    out = "x".join(map(str, (*shape[:-1], k)))
    props = f"k = {k} : i64" + ("" if order == "score" else ', order = "index"')
    text = (
        f"func.func @f(%x: tensor<{s}x{dtype}>) -> (tensor<{out}x{dtype}>, tensor<{out}xi32>) {{\n"
        f"  %v, %i = moe.topk %x {{{props}}} : tensor<{s}x{dtype}> -> tensor<{out}x{dtype}>, tensor<{out}xi32>\n"
        f"  func.return %v, %i : tensor<{out}x{dtype}>, tensor<{out}xi32>\n}}"
    )
    module = Parser(make_context(), text).parse_module()
    module.verify()
    return module


@cache
def modules(shape: tuple[int, ...], k: int, dtype: str, order: str, strategy: str) -> tuple[ModuleOp, ModuleOp]:
    before = topk_module(shape, k, dtype, order)
    return before, apply_pipeline(before, parse_pipeline(f"lower-topk{{strategy={strategy}}}"))



def assert_same(before: ModuleOp, after: ModuleOp, x: np.ndarray) -> None:
    want = run_function(before, "f", [x])
    got = run_function(after, "f", [x])
    for name, w, g in zip(("values", "indices"), want, got):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape, w.dtype, w.shape)
        assert np.array_equal(bits(g), bits(w)), f"{name} differ for input\n{x!r}\nwant {w!r}\ngot {g!r}"


def ops_named(module: ModuleOp, cls: type) -> list:
    return [op for op in module.walk() if isinstance(op, cls)]


# ---------------------------------------------------------------------------------------------
# Adversarial scores

BF16_SPECIAL = np.array(
    [0x7FC0, 0xFF80, 0x0000, 0x8000, 0x7F80, 0xFFC0, 0x7F81, 0xFFFF, 0x7FFF, 0x0001, 0x8001, 0x007F,
     0x807F, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80, 0x3F81, 0xBF81],
    dtype=np.uint16,
).view(ml_dtypes.bfloat16)
F32_SPECIAL = np.array(
    [0x7FC00000, 0xFF800000, 0x00000000, 0x80000000, 0x7F800000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF,
     0x7FFFFFFF, 0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000,
     0xBF800000, 0x3F800001, 0xBF800001, 0x3F810000],
    dtype=np.uint32,
).view(np.float32)
I32_SPECIAL = np.array([-(2**31), -(2**31) + 1, -1, 0, 1, 2**31 - 2, 2**31 - 1, 7, -7], dtype=np.int32)
SPECIAL = {"bf16": BF16_SPECIAL, "f32": F32_SPECIAL, "i32": I32_SPECIAL}


def adversarial(shape: tuple[int, ...], dtype: str, seed: int, style: str,
                picks: tuple[int, ...] = ()) -> np.ndarray:
    """Scores drawn from special values and a few ordinary ones (so ties are common): `few`
    rows use only the special values `picks`, `equal` makes every element the first pick,
    `mixed` also makes some rows all equal, `wide` draws mostly distinct values."""
    rng = np.random.default_rng(seed)
    special = SPECIAL[dtype]
    if dtype == "i32":
        ordinary = rng.integers(-4, 4, size=6).astype(np.int32)
    else:
        ordinary = np.round(rng.standard_normal(6), 1).astype(np.float32).astype(DTYPES[dtype])
    if style == "wide":
        if dtype == "i32":
            return rng.integers(-(2**31), 2**31, size=shape, dtype=np.int64).astype(np.int32)
        return rng.standard_normal(shape).astype(np.float32).astype(DTYPES[dtype])
    picked = special[[p % len(special) for p in picks or (0,)]]
    pool = {"special": special, "ordinary": ordinary, "few": picked, "equal": picked[:1]}.get(
        style, np.concatenate([special, ordinary]))
    x = pool[rng.integers(0, len(pool), size=shape)]
    if style == "mixed" and len(shape) > 1:
        rows = x.reshape(-1, shape[-1])
        for r in rng.choice(len(rows), size=max(1, len(rows) // 3), replace=False):
            rows[r] = pool[rng.integers(len(pool))]
        x = rows.reshape(shape)
    return x.copy()


@st.composite
def topk_cases(draw: st.DrawFn) -> tuple:
    e = draw(st.one_of(st.integers(1, 12), st.integers(1, 256)))
    k = draw(st.one_of(st.integers(1, min(e, 4)), st.integers(1, e)))
    limit = max(1, 3000 // (e * e) if e > 1 else 6)
    lead = draw(st.lists(st.integers(1, 3), max_size=2).filter(lambda ls: math.prod(ls) <= max(limit, 1)))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    order = draw(st.sampled_from(moe.TOPK_ORDERS))
    strategy = draw(st.sampled_from(STRATEGIES))
    style = draw(st.sampled_from(["few", "special", "ordinary", "mixed", "wide", "equal"]))
    picks = tuple(draw(st.lists(st.integers(0, 19), min_size=1, max_size=3)))
    seed = draw(st.integers(0, 2**32 - 1))
    return (*lead, e), k, dtype, order, strategy, style, picks, seed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topk_cases())
def test_lowered_topk_is_bit_identical(case: tuple) -> None:
    shape, k, dtype, order, strategy, style, picks, seed = case
    x = adversarial(shape, dtype, seed, style, picks)
    before, after = modules(shape, k, dtype, order, strategy)
    assert not ops_named(after, moe.TopKOp)
    assert_same(before, after, x)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("order", moe.TOPK_ORDERS)
def test_every_pair_and_triple_of_special_values(strategy: str, dtype: str, order: str) -> None:
    """Exhaustive over rows of three special values: every ordering question between them."""
    special = SPECIAL[dtype]
    n = len(special)
    grid = np.stack(np.meshgrid(*(np.arange(n),) * 3, indexing="ij"), axis=-1).reshape(-1, 3)
    x = special[grid]
    for k in (1, 2, 3):
        before, after = modules(x.shape, k, dtype, order, strategy)
        assert_same(before, after, x)


def test_every_bf16_bit_pattern() -> None:
    """All 65536 bf16 patterns, shuffled into rows of 32, ranked by both strategies."""
    patterns = np.random.default_rng(7).permutation(1 << 16).astype(np.uint16).view(ml_dtypes.bfloat16)
    x = patterns.reshape(2048, 32)
    for strategy in STRATEGIES:
        before, after = modules(x.shape, 4, "bf16", "score", strategy)
        assert_same(before, after, x)


def test_f32_is_ranked_exactly_not_through_bf16() -> None:
    """Values equal after rounding to bf16 still rank by their f32 value."""
    x = np.array([[1.0, 1.0 + 2**-20, 1.0 + 2**-21, 1.0 + 2**-23]], dtype=np.float32)
    for strategy in STRATEGIES:
        before, after = modules(x.shape, 2, "f32", "score", strategy)
        _, indices = run_function(after, "f", [x])
        assert indices.tolist() == [[1, 2]]
        assert_same(before, after, x)


def test_signed_zeros_tie_and_keep_their_sign() -> None:
    x = np.array([[-0.0, 0.0, -0.0]], dtype=np.float32)
    for dtype in ("f32", "bf16"):
        xs = x.astype(DTYPES[dtype])
        for strategy in STRATEGIES:
            _, after = modules(xs.shape, 2, dtype, "score", strategy)
            values, indices = run_function(after, "f", [xs])
            assert indices.tolist() == [[0, 1]]
            assert np.signbit(values.astype(np.float32)).tolist() == [[True, False]]


def test_nan_is_never_chosen_over_a_number_and_keeps_its_payload() -> None:
    x = np.array([0x7F81, 0xFF80, 0xFFC1, 0x0001], dtype=np.uint16).view(ml_dtypes.bfloat16).reshape(1, 4)
    for strategy in STRATEGIES:
        _, after = modules(x.shape, 4, "bf16", "score", strategy)
        values, indices = run_function(after, "f", [x])
        assert indices.tolist() == [[3, 1, 0, 2]]  # subnormal, -inf, then the NaNs by index
        assert values.view(np.uint16).tolist() == [[0x0001, 0xFF80, 0x7F81, 0xFFC1]]


def test_i32_min_ties_with_the_rounds_mask() -> None:
    """INT_MIN is a real i32 score and also the rounds strategy's mask value."""
    x = np.array([[-(2**31), 5, -(2**31), -(2**31)]], dtype=np.int32)
    for order in moe.TOPK_ORDERS:
        before, after = modules(x.shape, 4, "i32", order, "rounds")
        assert_same(before, after, x)
        _, indices = run_function(after, "f", [x])
        assert sorted(indices[0].tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_deepseek_group_shape(strategy: str) -> None:
    """Per-group top-2 on [T, G, E/G], as DeepSeek-V3's group-limited routing needs."""
    x = adversarial((4, 8, 32), "f32", 3, "mixed")
    before, after = modules(x.shape, 2, "f32", "score", strategy)
    assert_same(before, after, x)


def test_one_dimensional_and_single_element_axes() -> None:
    for shape, k in (((1,), 1), ((5,), 5), ((3, 1), 1), ((7,), 3)):
        for dtype in DTYPES:
            for strategy in STRATEGIES:
                before, after = modules(shape, k, dtype, "score", strategy)
                assert_same(before, after, adversarial(shape, dtype, 11, "mixed"))


def test_long_bf16_axis_falls_back_to_the_exact_f32_key() -> None:
    """Beyond 65536 elements the 16-bit index field cannot hold the index; bf16 is then ranked
    by its widening, and still returns its own bits."""
    e = (1 << 16) + 3
    x = adversarial((e,), "bf16", 5, "mixed")
    before, after = modules((e,), 2, "bf16", "score", "rounds")
    assert_same(before, after, x)
    _, all_pairs = modules((e,), 2, "bf16", "score", "rank")
    assert not any(isinstance(op, ve.OrOp) for op in all_pairs.walk())  # nothing packed


# ---------------------------------------------------------------------------------------------
# The op sequence and the pass interface


def test_packed_bf16_sequence_and_shapes() -> None:
    _, after = modules((16, 8), 2, "bf16", "score", "rank")
    names = [op.name for op in after.walk() if op.name.startswith("ve.")]
    for expected in ("ve.widen", "ve.or", "ve.shr_s", "ve.xor", "ve.broadcast", "ve.tag", "ve.reduce_sum",
                     "ve.filter", "ve.narrow"):
        assert expected in names
    (pairs,) = [op for op in ops_named(after, ve.ReduceSumOp) if op.input.type.get_shape() == (16, 8, 8)]
    assert pairs.result.type.get_shape() == (16, 8)
    assert all(f.result.type.get_shape() == (16, 2) for f in ops_named(after, ve.FilterOp))


def test_rounds_runs_k_reductions() -> None:
    _, after = modules((4, 16), 3, "bf16", "index", "rounds")
    assert len(ops_named(after, ve.ReduceMaxOp)) == 3
    assert not [op for op in ops_named(after, ve.BroadcastOp) if len(op.result.type.get_shape()) == 3]
    _, wide = modules((4, 16), 3, "f32", "index", "rounds")
    assert len(ops_named(wide, ve.ReduceMinOp)) == 3


def test_strategy_option() -> None:
    assert DEFAULT_STRATEGY == "rank"
    assert PASSES["lower-topk"]() is LowerTopKPass
    (p,) = parse_pipeline("lower-topk{strategy=rounds}")
    assert isinstance(p, LowerTopKPass) and p.strategy == "rounds"
    with pytest.raises(ValueError, match="unknown strategy 'fast'"):
        parse_pipeline("lower-topk{strategy=fast}")


# ---------------------------------------------------------------------------------------------
# Examples and the CLI


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_after_lower_topk_equals_its_reference(path: Path, strategy: str) -> None:
    program = tcpc.compile_file(path)
    pipeline = f"lower-topk{{strategy={strategy}}}"
    assert not ops_named(program.lower(pipeline), moe.TopKOp)
    for graph in program.graph_names:
        ref = program.run(seed=0, graph=graph)
        got = program.run(seed=0, graph=graph, reference=False, pipeline=pipeline)
        assert len(got.outputs) == len(ref.outputs)
        for g, w in zip(got.outputs, ref.outputs):
            assert g.dtype == w.dtype and np.array_equal(bits(g), bits(w))


def test_cli_compile_and_run_after_lower_topk(capsys: pytest.CaptureFixture[str]) -> None:
    example = str(ROOT / "examples" / "mixtral.moe")
    assert tcpc_main(["compile", example, "-p", "lower-topk"]) == 0
    ir = capsys.readouterr().out
    assert "moe.topk" not in ir and "ve.filter" in ir and "moe.scatter" in ir
    assert tcpc_main(["run", example, "-p", "lower-topk{strategy=rounds}", "--reference", "--check"]) == 0
    assert "check: outputs equal the reference" in capsys.readouterr().out
    assert tcpc_main(["compile", example, "-p", "lower-topk{strategy=bogus}"]) == 1
    assert "unknown strategy 'bogus'" in capsys.readouterr().err
