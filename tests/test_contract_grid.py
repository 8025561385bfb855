"""The contraction's fixed tile grid (runtime_sim/semantics/numerics.py, `contract`): a program
whose tiles fall on the grid (tile sizes multiples of GRID_M, GRID_N, GRID_K; the remainder at
the end) gives the bits of the whole contraction, and a K-tiled one that passes its running f32
accumulator as `acc` reproduces the whole contraction's summation order exactly."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from threadpoolctl import threadpool_info, threadpool_limits

from runtime_sim.semantics import numerics
from runtime_sim.semantics.numerics import GRID_K, GRID_M, GRID_N, bfloat16, contract
from support import bits


def cuts(size: int, chunk: int, draw: st.DrawFn) -> list[int]:
    """Tile edges over [0, size): random multiples of `chunk`, in order, ending at `size`."""
    inner = draw(st.lists(st.integers(1, max(1, (size - 1) // chunk)), max_size=3, unique=True))
    return [0, *sorted({c * chunk for c in inner if c * chunk < size}), size]


@st.composite
def tiled_problem(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, list[int], list[int], list[int]]:
    m = draw(st.integers(1, 2 * GRID_M + 40))
    k = draw(st.integers(1, 2 * GRID_K + 100))
    n = draw(st.integers(1, 2 * GRID_N + 100))
    batch = draw(st.integers(1, 2))
    rng = np.random.default_rng(draw(st.integers(0, 1000)))
    dtype = draw(st.sampled_from([np.float32, bfloat16]))
    a = rng.standard_normal((batch, m, k)).astype(np.float32).astype(dtype)
    b = (rng.standard_normal((batch, k, n)) / np.sqrt(k)).astype(np.float32).astype(dtype)
    return a, b, cuts(m, GRID_M, draw), cuts(n, GRID_N, draw), cuts(k, GRID_K, draw)



@settings(max_examples=25, deadline=None)
@given(tiled_problem())
def test_aligned_tilings_give_the_bits_of_one_call(problem) -> None:
    a, b, m_cuts, n_cuts, k_cuts = problem
    spec = "gmk,gkn->gmn"
    whole = contract(spec, a, b)
    tiled = np.empty_like(whole)
    for m0, m1 in zip(m_cuts, m_cuts[1:]):
        for n0, n1 in zip(n_cuts, n_cuts[1:]):
            acc = None
            for k0, k1 in zip(k_cuts, k_cuts[1:]):  # K in order, the running sum carried as acc
                acc = contract(spec, a[:, m0:m1, k0:k1], b[:, k0:k1, n0:n1], acc=acc)
            tiled[:, m0:m1, n0:n1] = acc
    assert np.array_equal(bits(tiled), bits(whole))


def test_a_cut_off_the_grid_changes_bits() -> None:
    """What the grid is for: summing K in pieces that are not whole GRID_K chunks changes the
    order of the additions, and here the bits (so the test above could fail)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((1, 64, 2 * GRID_K)).astype(np.float32)
    b = rng.standard_normal((1, 2 * GRID_K, 64)).astype(np.float32)
    whole = contract("gmk,gkn->gmn", a, b)
    half = GRID_K // 2
    first = contract("gmk,gkn->gmn", a[:, :, :half], b[:, :half])
    off_grid = contract("gmk,gkn->gmn", a[:, :, half:], b[:, half:], acc=first)
    assert not np.array_equal(bits(off_grid), bits(whole))


def test_acc_is_the_starting_value_of_the_sum() -> None:
    a = np.ones((1, 2, 3), np.float32)
    b = np.ones((1, 3, 4), np.float32)
    acc = np.full((1, 2, 4), 10.0, np.float32)
    assert np.array_equal(contract("gmk,gkn->gmn", a, b, acc=acc), np.full((1, 2, 4), 13.0, np.float32))
    assert np.array_equal(contract("mk,kn->nm", a[0], b[0], acc=acc[0].T), np.full((4, 2), 13.0, np.float32))


@settings(max_examples=25, deadline=None)
@given(blocks=st.integers(1, 4), rows=st.sampled_from([1, 3, 16, 40, 128, 200]), k=st.sampled_from([8, 300, 600]),
       n=st.sampled_from([4, 64, 520]), dtype=st.sampled_from([np.float32, bfloat16]), with_acc=st.booleans(),
       seed=st.integers(0, 1000))
def test_blocks_sharing_one_weight_keep_each_blocks_bits(blocks: int, rows: int, k: int, n: int, dtype: type,
                                                         with_acc: bool, seed: int) -> None:
    """`gbd,df->gbf` (a group of blocks by one expert's weight, schedule-experts' groups) gives
    each block the bits of its own contraction, `bd,df->bf` or the block's `gbd,gdf->gbf`, though
    numpy's products change their last bits with the rows one call holds; and an accumulator of
    -0.0 (the additive identity) changes no bit, signed zeros included."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((blocks, rows, k)).astype(np.float32).astype(dtype)
    x[0, 0] = 0.0  # a zero row: its sums are signed zeros
    w = rng.standard_normal((k, n)).astype(np.float32).astype(dtype)
    acc = rng.standard_normal((blocks, rows, n)).astype(np.float32) if with_acc else None
    shared = contract("gbd,df->gbf", x, w, acc)
    for g in range(blocks):
        own = contract("bd,df->bf", np.asarray(x[g], np.float32), np.asarray(w, np.float32), None if acc is None else acc[g])
        batched = contract("gbd,gdf->gbf", x[g:g + 1], w[None], None if acc is None else acc[g:g + 1])[0]
        assert np.array_equal(bits(shared[g]), bits(own)) and np.array_equal(bits(shared[g]), bits(batched))
    if acc is None:
        minus_zero = np.full(shared.shape, -0.0, np.float32)
        assert np.array_equal(bits(contract("gbd,df->gbf", x, w, minus_zero)), bits(shared))


def test_blocks_sharing_one_weight_fill_its_tiles_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 blocks of 64 rows by one weight are 4 tile products of GRID_M rows, the blocks' rows
    stacked, not 8 of 64 rows padded with zeros to GRID_M (a row's bits do not depend on the
    rows beside it, so any rows may share a tile: half the multiplies of a Qwen3 expert block)."""
    lhs_rows: list[int] = []
    real = numerics._blas_tile

    def counted(v: np.ndarray) -> np.ndarray:
        if v.shape[-1] == 40:  # the lhs's tiles, [items, rows, K]
            lhs_rows.append(v.shape[0] * v.shape[1])
        return real(v)

    monkeypatch.setattr(numerics, "_blas_tile", counted)
    rng = np.random.default_rng(0)
    contract("gbd,df->gbf", rng.standard_normal((8, 64, 40)).astype(np.float32), rng.standard_normal((40, 8)).astype(np.float32))
    assert lhs_rows == [GRID_M] * 4


def blas_threads() -> int:
    """The thread limit of the BLAS numpy uses, as threadpoolctl reads it now."""
    return max(info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas")


def test_every_tile_product_runs_on_one_blas_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """`contract` limits BLAS to one thread around its tile products, whatever the caller set,
    and gives the caller's limit back: OpenBLAS splits a large product over its threads and
    may then round differently, so the bits would depend on the machine's core count. Checked
    at each np.matmul call, so it holds on any machine (one core, or a BLAS that happens to
    round alike on two threads)."""
    seen: list[int] = []
    matmul = np.matmul

    def spy(*args: object, **kwargs: object) -> np.ndarray:
        seen.append(blas_threads())
        return matmul(*args, **kwargs)

    rng = np.random.default_rng(1)
    a = rng.standard_normal((1, 64, GRID_K)).astype(np.float32)
    b = rng.standard_normal((1, GRID_K, GRID_N)).astype(np.float32)
    with threadpool_limits(2, user_api="blas"):
        before = blas_threads()
        monkeypatch.setattr(np, "matmul", spy)
        contract("gmk,gkn->gmn", a, b)
        monkeypatch.undo()
        after = blas_threads()
    assert seen and set(seen) == {1}
    assert after == before


def test_the_bits_are_the_one_thread_bits() -> None:
    """The pinned bits are those of a one-thread product, with the caller's BLAS on two threads."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((1, 64, GRID_K)).astype(np.float32)
    b = rng.standard_normal((1, GRID_K, GRID_N)).astype(np.float32)
    with threadpool_limits(1, user_api="blas"):
        one = np.matmul(a, b)
    with threadpool_limits(2, user_api="blas"):
        pinned = contract("gmk,gkn->gmn", a, b)
    assert np.array_equal(bits(pinned), bits(one))


def test_contractions_in_several_python_threads_all_run_on_one_blas_thread() -> None:
    """A mesh simulates each chip in a Python thread: one thread finishing its contraction must
    not give BLAS its threads back while another is still contracting."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((1, 64, GRID_K)).astype(np.float32)
    b = rng.standard_normal((1, GRID_K, GRID_N)).astype(np.float32)
    with threadpool_limits(1, user_api="blas"):
        one = np.matmul(a, b)
    results: list[np.ndarray] = []

    def chip() -> None:
        for _ in range(6):
            results.append(contract("gmk,gkn->gmn", a, b))

    threads = [threading.Thread(target=chip) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 18 and all(np.array_equal(bits(r), bits(one)) for r in results)
