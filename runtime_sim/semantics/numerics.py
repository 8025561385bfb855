"""Element types and rounding points shared by every level.

See docs/architecture.md#numbers-and-rounding.

Storage is bf16, f32, i32 or i1; float arithmetic happens in f32 and each op's result is rounded
to its type (round to nearest even, as ml_dtypes casts).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ml_dtypes
import numpy as np
from threadpoolctl import ThreadpoolController
from xdsl.dialects.builtin import (
    BFloat16Type,
    Float4E2M1FNType,
    Float8E4M3FNType,
    Float8E5M2Type,
    Float8E8M0FNUType,
    Float32Type,
    IntegerType,
    TensorType,
)
from xdsl.ir import Attribute

from dialects import ve
from dialects.tensor_types import U3, code_tile_bytes

bfloat16 = np.dtype(ml_dtypes.bfloat16)
TAG_DTYPE = np.dtype(np.uint8)
"""Storage of a `ve` branch tag (4 bits, 0..15)."""

DTYPE_NAMES = ("bf16", "f32", "i32")
"""The element types a .moe program computes with (comparisons add i1; the low-precision
storage types below are declared too, but take no arithmetic)."""

float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3fn)
"""f8e4m3: the `fn` variant (no inf, NaN = S.1111.111, max 448), torch.float8_e4m3fn."""
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
"""f8e5m2: IEEE-like (inf and NaN), max 57344."""
float4_e2m1 = np.dtype(ml_dtypes.float4_e2m1fn)
"""f4e2m1: MXFP4's values (no inf, no NaN, max 6); numpy stores one per byte, the chip two."""
float8_e8m0 = np.dtype(ml_dtypes.float8_e8m0fnu)
"""e8m0: MX block scales, 2^(e - 127) (NaN = 0xff, no zero, no sign)."""

code3 = np.dtype(np.int8)
"""u3 codes (0..7), one per byte in numpy (no other element type is stored as int8); the chip
packs them 3 bits each in 16 x 16 tiles (`stored_nbytes`)."""

LOW_PRECISION_DTYPES = (float8_e4m3, float8_e5m2, float4_e2m1)
"""The quantized value types: conversion to them saturates (see `round_to`)."""


def numpy_dtype(element_type: Attribute) -> np.dtype:
    """The numpy storage dtype of an xDSL element type: the one mapping every level uses."""
    if ve.is_tag_type(element_type):
        return TAG_DTYPE
    if isinstance(element_type, BFloat16Type):
        return bfloat16
    if isinstance(element_type, Float32Type):
        return np.dtype(np.float32)
    if isinstance(element_type, Float8E4M3FNType):
        return float8_e4m3
    if isinstance(element_type, Float8E5M2Type):
        return float8_e5m2
    if isinstance(element_type, Float4E2M1FNType):
        return float4_e2m1
    if isinstance(element_type, Float8E8M0FNUType):
        return float8_e8m0
    if element_type == U3:
        return code3
    if isinstance(element_type, IntegerType):
        width = element_type.width.data
        if width == 1:
            return np.dtype(np.bool_)
        if width == 32:
            return np.dtype(np.int32)
    raise ValueError(f"no numpy storage for element type {element_type}")


def tensor_dtype(tensor_type: Attribute) -> np.dtype:
    assert isinstance(tensor_type, TensorType)
    return numpy_dtype(tensor_type.get_element_type())


def is_float(dtype: np.dtype) -> bool:
    return dtype == bfloat16 or dtype == np.float32


def is_low_precision(dtype: np.dtype) -> bool:
    return dtype in LOW_PRECISION_DTYPES or dtype == float8_e8m0


def raw_bits(x: np.ndarray) -> np.ndarray:
    """The array viewed as unsigned integers of its width: the same bits, for moving rows.
    numpy copies an ml_dtypes type (bf16, the fp8s) element by element when it gathers or
    scatters rows by index; as integers it copies them in bulk."""
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


_SELECT_BY_MASKS = (4096, 1 << 20)
"""The sizes (elements) at which `select` moves bits by masks rather than calling np.where:
below, the masks' few numpy calls cost more than a short where; above, the arrays leave the
cache and where's one pass beats the masks' several (and a large mask is mostly a regular
pattern, which where's branches predict: cost-only routing's [32768, 256] selects)."""


def select(hit: np.ndarray, on_true: np.ndarray, on_false: np.ndarray) -> np.ndarray:
    """np.where(hit, on_true, on_false), by bit masks when both sides have one dtype of 1, 2, 4
    or 8 bytes: the same bits (each element is one side's, moved whole), without numpy's
    branch per element, which a random mask mispredicts (a top-k ranking's [48, 128, 128]
    selects: about ten times faster). Short and very long arrays go to np.where."""
    on_true, on_false = np.asarray(on_true), np.asarray(on_false)
    if on_true.dtype != on_false.dtype or on_true.dtype.itemsize not in (1, 2, 4, 8) or on_true.dtype == np.bool_:
        return np.where(hit, on_true, on_false)
    shape = np.broadcast_shapes(np.shape(hit), on_true.shape, on_false.shape)
    if not _SELECT_BY_MASKS[0] <= math.prod(shape) <= _SELECT_BY_MASKS[1]:
        return np.where(hit, on_true, on_false)
    width = np.dtype(f"u{on_true.dtype.itemsize}")
    mask = np.broadcast_to(np.asarray(hit, np.bool_), shape).astype(width)
    np.negative(mask, out=mask)  # 1 -> all ones (unsigned wrap-around), 0 -> 0
    f = raw_bits(np.broadcast_to(on_false, shape))
    out = np.bitwise_xor(f, raw_bits(np.broadcast_to(on_true, shape)))
    out &= mask  # where hit: the bits in which on_true differs from on_false; elsewhere 0
    out ^= f
    return out.view(on_true.dtype)


def stored_nbytes(value: object) -> int:
    """Bytes a value occupies in the chip's memory: its elements at their stored width, so
    f4e2m1 counts half a byte each (numpy keeps one per byte), u3 codes their 16 x 16 tiles of
    96 bytes. What every cost counts."""
    dtype = getattr(value, "dtype", None)
    nbytes = int(getattr(value, "nbytes", 0))
    if dtype == float4_e2m1:
        return -(-nbytes // 2)
    if dtype == code3:
        return code_tile_bytes(np.shape(value))
    return nbytes


def compute(x: np.ndarray) -> np.ndarray:
    """The array in its arithmetic type: floats (and stored low-precision values, exactly) in
    f32, integers and booleans as they are."""
    if is_float(x.dtype) or is_low_precision(x.dtype):
        return x.astype(np.float32)
    return x


def round_to(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Round an f32 (or integer, or boolean) result to its storage type.

    f32 to bf16 rounds to nearest even; float to i32 truncates toward zero, NaN and
    out-of-range values saturate to the i32 limits (NaN to 0), so no result is undefined.
    """
    x = np.asarray(x)
    if dtype == np.int32 and is_float(x.dtype) or (dtype == np.int32 and x.dtype == np.float64):
        info = np.iinfo(np.int32)
        f = np.nan_to_num(x.astype(np.float64), nan=0.0, posinf=info.max, neginf=info.min)
        return np.trunc(np.clip(f, info.min, info.max)).astype(np.int32)
    if dtype == np.bool_:
        return x.astype(np.bool_)
    if dtype == bfloat16 and x.dtype != np.float32 and x.dtype.kind == "f":
        # Round once to f32 first: every level computes in f32, never in f64.
        x = x.astype(np.float32)
    if dtype in LOW_PRECISION_DTYPES:
        return saturate_to(np.asarray(x, np.float32), dtype)
    return x.astype(dtype)


def saturate_to(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """f32 to a low-precision type, saturating: values beyond the largest finite value (inf
    included) become it, with their sign; the rest round to nearest even (ml_dtypes' cast);
    NaN stays NaN (f4e2m1 has none: ml_dtypes gives -0 there).
    The conversion of the cast engine and of vLLM's `clamp(x / s, -max, max).to(fp8)`."""
    limit = np.float32(ml_dtypes.finfo(dtype).max)
    return np.clip(x, -limit, limit).astype(dtype)


_FOLD_MIN_LINE = 64
"""Elements per step from which `_sequential` folds an outer axis step by step."""


def _sequential(ufunc: np.ufunc, x: np.ndarray, axis: int, keepdims: bool) -> np.ndarray:
    """`ufunc` folded along `axis` left to right, in x's type: total = ufunc(total, next).
    Along the last axis ufunc.accumulate does it; along an outer axis a loop over it does the
    same steps on whole slices (numpy's accumulate over an outer axis is about ten times
    slower), when the slices are large enough to pay for the Python steps."""
    axis = axis % x.ndim if x.ndim else axis
    n = x.shape[axis]
    if n == 0:
        return ufunc.reduce(x, axis=axis, keepdims=keepdims)
    if axis != x.ndim - 1 and x.size // n >= _FOLD_MIN_LINE:
        steps = np.moveaxis(x, axis, 0)
        total = np.array(steps[0])
        for i in range(1, n):
            ufunc(total, steps[i], out=total, dtype=x.dtype)
        return np.expand_dims(total, axis) if keepdims else total
    total = np.take(ufunc.accumulate(x, axis=axis, dtype=x.dtype), [-1], axis=axis)
    return total if keepdims else np.squeeze(total, axis=axis)


def sequential_sum(x: np.ndarray, axis: int, keepdims: bool = False) -> np.ndarray:
    """Sum along one axis strictly left to right, in the array's type (f32 rounds at every add,
    i32 wraps): the order in which an engine accumulates over the time axis. Every level sums
    this way, so a reduction gives the same bits before and after lowering (numpy's own sum is
    pairwise along contiguous axes, an order no engine follows)."""
    return _sequential(np.add, x, axis, keepdims)


def sequential_max(x: np.ndarray, axis: int, keepdims: bool = False) -> np.ndarray:
    """Maximum along one axis, folded left to right with np.maximum (NaN propagates: the first
    NaN met wins, its bits unchanged). Every level takes maxima this way: numpy's own np.max
    picks between +0.0 and -0.0, and between NaN payloads, by its vector width and the array's
    layout (a long row can even give the default NaN instead of the one in the data)."""
    return _sequential(np.maximum, x, axis, keepdims)


def sequential_min(x: np.ndarray, axis: int, keepdims: bool = False) -> np.ndarray:
    """Minimum along one axis, folded left to right with np.minimum (see `sequential_max`)."""
    return _sequential(np.minimum, x, axis, keepdims)


def contract(spec: str, lhs: np.ndarray, rhs: np.ndarray, acc: np.ndarray | None = None) -> np.ndarray:
    """`einsum(spec, lhs, rhs)` in f32, by the one routine every level uses for a contraction:
    the operands are arranged as [batch, M, K] and [batch, K, N] (batch letters: in both
    operands and the result; M: lhs and result only; N: rhs and result only; K: summed) and
    multiplied on a fixed tile grid (`_matmul_f32`: [GRID_M x GRID_N] output chunks, K summed
    in GRID_K chunks strictly in order into an f32 accumulator), then arranged as `spec` says.
    A letter of one operand only that the result drops is summed first, left to right.

    numpy's products differ in the last bits with the number of rows a tile holds, where the
    chip's accumulation order per result element does not: every tile product holds GRID_M rows
    (zeros below the last), so any rows taken alone give the bits they have in the whole
    contraction, wherever the rows are cut. So the lhs-only letters of a contraction by one rhs
    are all rows, their tiles filled in turn (`gbd,df->gbf`: the g blocks' rows stacked, eight
    blocks of 64 rows four tile products, not eight padded ones), and each block still gets the
    bits of its own `gbd,gdf->gbf` product (the schedule level's expert groups,
    passes/schedule/schedule_experts.py). With several rhs batch items, every lhs-only letter of
    the result but the last is evaluated like a batch letter, the rhs shared by each of its indices.

    `acc` (f32, the result's shape) is the accumulator's initial value: the K chunks are added
    to it in order. A contraction split along K at multiples of GRID_K, each piece passing the
    previous piece's f32 result as `acc`, gives the bits of the whole contraction; one split
    along M anywhere, or along N at multiples of GRID_N, gives them too (each output row is the
    same matmuls on the same data).

    The graph's matmul (`tmath.matmul`) and the contraction engine's op (`tcp.contract`) both
    run through here with the same spec and shapes, so a lowered matmul gives the reference's
    bits. np.einsum is not used: it accumulates in its own order, a few ulps away from
    np.matmul's.

    Operands may be bf16: they are converted to f32 a few batch items at a time (the same
    values, and np.matmul runs one BLAS call per item either way), so a large gathered
    operand is never copied whole to f32. An operand may also be a `GatheredRows` (a DMA
    gather not materialised): when its rows are the batch items in order it is gathered a few
    items at a time too, and it is materialised otherwise."""
    inputs, _, out = spec.partition("->")
    a, b = inputs.split(",")
    if len(set(a)) != len(a) or len(set(b)) != len(b):
        raise ValueError(f"contraction spec {spec!r} repeats a letter within an operand")
    x = lhs if isinstance(lhs, GatheredRows) else _f32_or_bf16(lhs)
    y = rhs if isinstance(rhs, GatheredRows) else _f32_or_bf16(rhs)
    for axis in reversed(range(len(a))):
        if a[axis] not in b and a[axis] not in out:
            x = sequential_sum(np.asarray(x, np.float32), axis)
    for axis in reversed(range(len(b))):
        if b[axis] not in a and b[axis] not in out:
            y = sequential_sum(np.asarray(y, np.float32), axis)
    a = "".join(c for c in a if c in b or c in out)
    b = "".join(c for c in b if c in a or c in out)
    size = dict(zip(a, x.shape)) | dict(zip(b, y.shape))
    batch = [c for c in out if c in a and c in b]
    left = [c for c in out if c in a and c not in b]
    right = [c for c in out if c in b and c not in a]
    summed = [c for c in a if c in b and c not in out]
    if math.prod(size[c] for c in batch) == 1:  # one rhs: the rows of every lhs-only index fill its tiles
        shared = []
    else:  # lhs-only letters but the last: batch items sharing the rhs
        shared, left = left[:-1], left[-1:]

    def arranged(v: np.ndarray, letters: str, order: list[str], groups: list[list[str]]) -> np.ndarray:
        shape = tuple(math.prod(size[c] for c in g) for g in groups)
        if isinstance(v, GatheredRows):
            if order == list(letters) and len(batch) == 1:  # row g is batch item g
                return _Batches(v, shape)  # type: ignore[return-value]
            v = _f32_or_bf16(np.asarray(v))
        v = np.transpose(v, [letters.index(c) for c in order])
        return np.ascontiguousarray(v.reshape([math.prod(size[c] for c in g) for g in groups]))

    result = shared + batch + left + right
    start = None
    if acc is not None:
        acc = np.asarray(acc, np.float32)
        start = np.transpose(acc, [out.index(c) for c in result]).reshape(
            [math.prod(size[c] for c in g) for g in (shared + batch, left, right)])
    rhs_items = arranged(y, b, batch + summed + right, [batch, summed, right])
    if shared:
        rhs_items = _Shared(rhs_items, math.prod(size[c] for c in shared))  # type: ignore[assignment]
    with one_blas_thread():
        product = _matmul_f32(arranged(x, a, shared + batch + left + summed, [shared + batch, left, summed]),
                              rhs_items, start)
    product = product.reshape([size[c] for c in result])
    return np.transpose(product, [result.index(c) for c in out])


GRID_M = 128
GRID_N = 512
GRID_K = 512
"""The contraction's tile grid (`_matmul_f32`): output chunks of GRID_M rows x GRID_N columns,
each summing its K in chunks of GRID_K, in order. Assumption about the chip's accumulation
order (docs/hardware.md, assumptions): the contraction engine reduces a bounded piece of K per
pass and adds the passes in K order into an f32 accumulator. The grid is what makes tiled
programs exact: tiles whose edges fall on the grid give the bits of the whole contraction."""

class _OneBlasThread:
    """The state behind `one_blas_thread`: how many contractions run now, in any Python thread
    (a mesh simulates each chip in its own thread, runtime_sim/semantics/ccl_semantics.py). The
    first to start limits BLAS to one thread, the last to finish restores the limit it found,
    so no contraction runs while another thread restores it. (threadpoolctl lets one Python
    thread at a time change OpenBLAS's limit and ignores the others: a restore from another
    thread leaves BLAS on one thread, never more.)"""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.controller: ThreadpoolController | None = None
        self.limiter: Any = None

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self.lock:
            if self.running == 0:
                if self.controller is None:  # finds the BLAS numpy loaded, once (a millisecond)
                    self.controller = ThreadpoolController()
                self.limiter = self.controller.limit(limits=1, user_api="blas")
            self.running += 1
        try:
            yield
        finally:
            with self.lock:
                self.running -= 1
                if self.running == 0:
                    self.limiter.restore_original_limits()
                    self.limiter = None


one_blas_thread = _OneBlasThread()
"""`with one_blas_thread():` BLAS limited to one thread while the block runs: every tile product
of `contract` is one single-threaded BLAS call. OpenBLAS splits a product above a size
threshold over its threads and then rounds differently (a [64, 512] x [512, 512] tile: about a
sixth of its f32 results differ by an ulp between 1 and 2 threads; tests/test_contract_grid.py),
so with the library's default, one thread per core, a contraction's bits would depend on the
machine's core count and OPENBLAS_NUM_THREADS. One thread is also the faster choice for the
simulator's tiles on a busy machine (threads of a small product wait for each other). Costs a
few microseconds."""


_CHUNK_ELEMENTS = 1 << 21
"""Operand elements converted to f32 at once by `_matmul_f32` (8 MB of f32: small enough for
the allocator to reuse the memory rather than map fresh pages every time)."""


def _f32_or_bf16(x: np.ndarray) -> np.ndarray:
    """bf16 stays bf16 (converted later, in pieces); everything else becomes f32."""
    x = np.asarray(x)
    return x if x.dtype == bfloat16 else np.asarray(x, np.float32)


def _matmul_f32(a: np.ndarray, b: np.ndarray, acc: np.ndarray | None = None) -> np.ndarray:
    """[batch, M, K] @ [batch, K, N] in f32 on the fixed tile grid: every [GRID_M x GRID_N]
    output chunk sums its K in GRID_K chunks, each one np.matmul of f32 tiles (one BLAS call
    per batch item, `_blas_tile`), added strictly in K order to an f32 accumulator that starts
    from `acc` ([batch, M, N]) when given and from the first chunk's product otherwise. bf16
    operands are converted a few batch items at a time."""
    batch, m, k = a.shape
    n = b.shape[2]
    if k == 0:
        return np.zeros((batch, m, n), np.float32) if acc is None else np.array(acc, np.float32)
    one_chunk = m == GRID_M and n <= GRID_N and k <= GRID_K
    lazy = isinstance(a, (_Batches, _Shared)) or isinstance(b, (_Batches, _Shared))
    if one_chunk and acc is None and a.dtype == np.float32 and b.dtype == np.float32 and not lazy:
        return np.matmul(a, b)
    out = np.empty((batch, m, n), np.float32)
    step = max(1, _CHUNK_ELEMENTS // max(1, math.prod(a.shape[1:]) + math.prod(b.shape[1:])))
    for i in range(0, batch, step):
        j = min(batch, i + step)
        x, y = _items(a, i, j), _items(b, i, j)
        if one_chunk:
            product = np.matmul(x, y)
            out[i:j] = product if acc is None else acc[i:j] + product
            continue
        for m0 in range(0, m, GRID_M):
            rows = slice(m0, min(m, m0 + GRID_M))
            tile = x[:, rows]
            if rows.stop - m0 < GRID_M:  # every tile product has GRID_M rows: a row's bits never depend on how many share its tile
                tile = np.zeros((j - i, GRID_M, k), np.float32)
                tile[:, :rows.stop - m0] = x[:, rows]
            for n0 in range(0, n, GRID_N):
                cols = slice(n0, min(n, n0 + GRID_N))
                total = None if acc is None else acc[i:j, rows, cols]
                for k0 in range(0, k, GRID_K):
                    ks = slice(k0, min(k, k0 + GRID_K))
                    lhs, rhs = tile[:, :, ks], y[:, ks, cols]
                    if rhs.shape[2] == 1:  # a vector product: gemv
                        part = np.matmul(np.ascontiguousarray(lhs), np.ascontiguousarray(rhs))[:, :rows.stop - m0]
                    else:
                        part = np.matmul(_blas_tile(lhs), _blas_tile(rhs))[:, :rows.stop - m0]
                    total = part if total is None else total + part
                out[i:j, rows, cols] = total
    return out


def _blas_tile(v: np.ndarray) -> np.ndarray:
    """A tile np.matmul hands to BLAS: the view itself when BLAS can read it where it is (unit
    stride along its rows, numpy's own test), else a contiguous copy. BLAS copies each operand
    into its own packed buffers before multiplying, so a view with a leading dimension gives
    the bits of the contiguous copy (tests/test_numerics_fast_paths.py checks it); a tile
    numpy could not hand to BLAS would be multiplied by numpy's own loop, in another order.
    Callers copy both tiles of a product with one row or one column (`vector`): numpy hands
    it to BLAS's dot or gemv, whose kernels sum in an order that depends on the leading
    dimension (a [1, 3] @ [3, 1] tile of a 513-column operand differed in its last bit)."""
    rows, cols = v.strides[-2:]
    item = v.itemsize
    if cols == item and rows % item == 0 and rows // item >= v.shape[-1]:
        return v
    return np.ascontiguousarray(v)


def _items(v: np.ndarray | _Batches | _Shared, i: int, j: int) -> np.ndarray:
    """Batch items i..j-1 of an arranged operand, in f32 (a view when it is f32 already)."""
    if isinstance(v, (_Batches, _Shared)):
        return v.items(i, j)
    return v[i:j].astype(np.float32, copy=False)


class _Shared:
    """An arranged rhs [batch, K, N] shared by `copies` indices of lhs-only letters: item i is
    the rhs's batch item i mod batch (every index of the shared letters, outermost, meets
    every batch item), never copied as a whole."""

    def __init__(self, base: np.ndarray | _Batches, copies: int):
        self.base, self.batch = base, base.shape[0]
        self.shape: tuple[int, ...] = (copies * self.batch, *base.shape[1:])
        self.dtype = base.dtype

    def items(self, i: int, j: int) -> np.ndarray:
        return np.concatenate([_items(self.base, t % self.batch, t % self.batch + 1) for t in range(i, j)])


class GatheredRows:
    """The result of a DMA gather, `source[indices]` with zero rows where an index is -1, not
    materialised: `rows(i, j)` gives items i..j-1 along its first axis (the first axis of the
    indices), and numpy gets
    the whole array (`np.asarray`) on demand. The simulator's gather returns one when only
    contractions read its result (runtime_sim/semantics/tcp_semantics.py), so a prefill's gathered
    expert weights (gigabytes, the same rows over and over) are never copied whole."""

    def __init__(self, source: np.ndarray, indices: np.ndarray):
        self.source = source
        self.indices = np.asarray(indices)
        self.shape: tuple[int, ...] = (*self.indices.shape, *source.shape[1:])
        self.dtype = source.dtype
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize
        self._whole: np.ndarray | None = None

    def rows(self, i: int, j: int) -> np.ndarray:
        return self._gather(self.indices[i:j])

    def _gather(self, idx: np.ndarray) -> np.ndarray:
        # On the raw bits; zero bits are a zero row.
        out = raw_bits(self.source)[np.maximum(idx, 0)]
        out[idx < 0] = 0
        return out.view(self.dtype)

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        if self._whole is None:
            self._whole = self._gather(self.indices)
        return self._whole if dtype is None else self._whole.astype(dtype)


class _Batches:
    """A GatheredRows arranged as [batch, rows, columns]: batch item g is row g, reshaped."""

    def __init__(self, rows: GatheredRows, shape: tuple[int, ...]):
        self.rows, self.shape, self.dtype = rows, shape, rows.dtype

    def items(self, i: int, j: int) -> np.ndarray:
        return self.rows.rows(i, j).reshape((j - i, *self.shape[1:])).astype(np.float32)
