"""The simulator's fast paths give the bits of the plain ones (runtime_sim/semantics/numerics.py):
a fold along an outer axis done slice by slice equals numpy's accumulate along it, NaN, signed
zeros and i32 wrap-around included; a select by bit masks equals np.where; rows moved as raw bits
are the rows; a contraction whose tiles BLAS reads in place gives the bits of the grid of
contiguous copies; branch tags matched by a table are np.isin's matches."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from threadpoolctl import threadpool_limits

from runtime_sim.semantics.numerics import (
    TAG_DTYPE,
    _SELECT_BY_MASKS,
    GRID_K,
    GRID_M,
    GRID_N,
    bfloat16,
    contract,
    raw_bits,
    select,
    sequential_max,
    sequential_min,
    sequential_sum,
)
from runtime_sim.semantics.ve_semantics import tagged

FOLDS = {sequential_sum: np.add, sequential_max: np.maximum, sequential_min: np.minimum}


def accumulated(ufunc: np.ufunc, x: np.ndarray, axis: int, keepdims: bool) -> np.ndarray:
    """The plain fold: ufunc.accumulate along the axis, its last step."""
    total = np.take(ufunc.accumulate(x, axis=axis, dtype=x.dtype), [-1], axis=axis)
    return total if keepdims else np.squeeze(total, axis=axis)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(raw_bits(np.ascontiguousarray(a)),
                                                                         raw_bits(np.ascontiguousarray(b)))


@st.composite
def folded(draw: st.DrawFn) -> tuple[np.ndarray, int, bool]:
    dtype = draw(st.sampled_from([np.float32, np.int32]))
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=70))
    if dtype == np.float32:  # NaNs, infinities, signed zeros, subnormals: anything f32 holds
        elements = st.floats(width=32, allow_nan=True, allow_infinity=True)
    else:
        elements = st.integers(-(2**31), 2**31 - 1)
    x = draw(hnp.arrays(dtype, shape, elements=elements))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    return x, axis, draw(st.booleans())


@settings(max_examples=200, deadline=None)
@given(folded(), st.sampled_from(list(FOLDS)))
def test_a_fold_gives_the_bits_of_accumulate(case, fold) -> None:
    x, axis, keepdims = case
    with np.errstate(all="ignore"):  # overflow to inf is IEEE's, as the engines do (run_function)
        assert same_bits(fold(x, axis, keepdims), accumulated(FOLDS[fold], x, axis, keepdims))


def test_an_outer_axis_is_folded_slice_by_slice() -> None:
    """The shapes the fast path is for (a weighted sum over K of [rows, K, D]), with a NaN whose
    payload must survive and a -0.0 that must stay negative."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 8, 256)).astype(np.float32)
    x[3, 5, 7] = np.array(0x7FC00123, np.uint32).view(np.float32)
    x[4, :, 9] = -0.0
    for fold, ufunc in FOLDS.items():
        assert same_bits(fold(x, 1), accumulated(ufunc, x, 1, False))
    assert raw_bits(sequential_sum(x, 1))[3, 7] == 0x7FC00123
    assert np.signbit(sequential_sum(x, 1)[4, 9])


def test_raw_bits_move_bf16_rows_unchanged() -> None:
    x = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(bfloat16).reshape(256, 256)
    order = np.random.default_rng(1).permutation(256)
    moved = np.empty_like(x)
    raw_bits(moved)[order] = raw_bits(x)
    assert np.array_equal(raw_bits(moved[order]), raw_bits(x))  # every bf16 bit pattern, NaNs too


@st.composite
def selected(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A mask and two sides of one dtype, any of them possibly broadcast (as ve.const gives)."""
    dtype = draw(st.sampled_from([np.float32, np.int32, np.uint8, bfloat16, np.float64, np.bool_]))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=24))  # up to 13,824: both ways
    raw = np.dtype(f"u{np.dtype(dtype).itemsize}")

    def side() -> np.ndarray:  # any bit pattern: NaN payloads, -0.0, subnormals
        sub = shape[draw(st.integers(0, len(shape))):]
        bits = draw(hnp.arrays(raw, sub))
        return bits.astype(np.bool_) if dtype == np.bool_ else bits.view(dtype)

    return draw(hnp.arrays(np.bool_, shape)), side(), side()


@settings(max_examples=200, deadline=None)
@given(selected())
def test_a_select_gives_the_bits_of_where(case) -> None:
    hit, on_true, on_false = case
    assert same_bits(select(hit, on_true, on_false), np.where(hit, on_true, on_false))


def plain_grid_matmul(a: np.ndarray, b: np.ndarray, acc: np.ndarray | None) -> np.ndarray:
    """The contraction grid written plainly: every [GRID_M x GRID_N] output chunk of every batch
    item, its K in GRID_K chunks, each chunk one np.matmul of contiguous f32 copies of GRID_M
    rows (zeros below the operand's last) on one BLAS thread, summed in K order from `acc` (or
    from the first chunk)."""
    batch, m, k = a.shape
    n = b.shape[2]
    out = np.zeros((batch, m, n), np.float32) if acc is None else np.array(acc, np.float32)
    with threadpool_limits(1, user_api="blas"):
        for g in range(batch):
            for m0 in range(0, m, GRID_M):
                for n0 in range(0, n, GRID_N):
                    total = None if acc is None else acc[g, m0:m0 + GRID_M, n0:n0 + GRID_N]
                    for k0 in range(0, k, GRID_K):
                        x = np.zeros((GRID_M, min(k, k0 + GRID_K) - k0), np.float32)
                        rows = a[g, m0:m0 + GRID_M, k0:k0 + GRID_K]
                        x[:len(rows)] = rows
                        y = np.ascontiguousarray(b[g, k0:k0 + GRID_K, n0:n0 + GRID_N], np.float32)
                        part = np.matmul(x, y)[:len(rows)]
                        total = part if total is None else total + part
                    if total is not None:
                        out[g, m0:m0 + GRID_M, n0:n0 + GRID_N] = total
    return out


@st.composite
def grid_problem(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Shapes with remainders on every axis of the grid (and sizes of 1: BLAS's vector cases)."""
    dims = [draw(st.one_of(st.integers(1, 3), st.integers(1, 2 * c + 60))) for c in (GRID_M, GRID_K, GRID_N)]
    m, k, n = dims
    batch = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from([np.float32, bfloat16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    a = rng.standard_normal((batch, m, k)).astype(np.float32).astype(dtype)
    b = (rng.standard_normal((batch, k, n)) / np.sqrt(k)).astype(np.float32).astype(dtype)
    acc = rng.standard_normal((batch, m, n)).astype(np.float32) if draw(st.booleans()) else None
    return a, b, acc


def vector_chunks() -> tuple[np.ndarray, np.ndarray, None]:
    """One row times 513 columns: the last output chunk is a [1, 3] @ [3, 1] dot product,
    whose strided view BLAS summed in another order than the contiguous copy (hypothesis)."""
    rng = np.random.default_rng(0)
    return rng.standard_normal((1, 1, 3)).astype(np.float32), rng.standard_normal((1, 3, 2 * GRID_N + 1)).astype(np.float32), None


@settings(max_examples=40, deadline=None)
@given(grid_problem())
@example(vector_chunks())
def test_contract_gives_the_bits_of_the_plain_grid(problem) -> None:
    """contract's tiles are views BLAS reads in place, its f32 operands are not copied, its
    bf16 ones are widened a few items at a time: the bits of the plain grid all the same."""
    a, b, acc = problem
    got = contract("gmk,gkn->gmn", a, b, acc=acc)
    assert same_bits(got, plain_grid_matmul(a, b, acc))


@settings(max_examples=30, deadline=None)
@given(grid_problem(), st.integers(0, 2**16))
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(problem, seed: int) -> None:
    """Any rows of a contraction, taken alone, give the bits they have in the whole one (every
    tile product has GRID_M rows): a mesh chip's 16 tokens, a block's rows or a tile's are
    computed as the one-chip reference computes them, wherever the rows are cut."""
    a, b, _ = problem
    whole = contract("gmk,gkn->gmn", a, b)
    rng = np.random.default_rng(seed)
    lo = int(rng.integers(0, a.shape[1]))
    hi = int(rng.integers(lo + 1, a.shape[1] + 1))
    assert same_bits(contract("gmk,gkn->gmn", a[:, lo:hi], b), whole[:, lo:hi])


def test_a_large_select_moves_bits_by_masks() -> None:
    """A top-k ranking's select ([48, 128, 128], a size where masks take over), sides
    of random bits (NaN payloads included) and a broadcast constant, as ve.const gives."""
    rng = np.random.default_rng(2)
    shape = (48, 128, 128)
    assert _SELECT_BY_MASKS[0] <= math.prod(shape) <= _SELECT_BY_MASKS[1]
    hit = rng.integers(0, 2, shape).astype(np.bool_)
    for dtype in (np.float32, np.int32, bfloat16):
        raw = np.dtype(f"u{np.dtype(dtype).itemsize}")
        on_true = rng.integers(0, np.iinfo(raw).max, shape, dtype=raw, endpoint=True).view(dtype)
        on_false = np.broadcast_to(np.array(7, raw).view(dtype), shape)
        assert same_bits(select(hit, on_true, on_false), np.where(hit, on_true, on_false))


@given(hnp.arrays(st.sampled_from([TAG_DTYPE, np.dtype(np.int32)]), hnp.array_shapes(max_dims=3, max_side=9),
                  elements=st.integers(0, 15)),
       st.sets(st.integers(-3, 300), max_size=6))
def test_tags_matched_by_a_table_are_isin(tags: np.ndarray, values: set[int]) -> None:
    got = tagged(tags, values)
    assert got.dtype == np.bool_ and got.shape == tags.shape
    assert np.array_equal(got, np.isin(tags, list(values)))
