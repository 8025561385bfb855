"""Element types and rounding points shared by every level (DESIGN section 5).

Storage is bf16, f32, i32 or i1; float arithmetic happens in f32 and each op's result is rounded
to its type (round to nearest even, as ml_dtypes casts).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from xdsl.dialects.builtin import (
    BFloat16Type,
    Float32Type,
    IntegerType,
    TensorType,
)
from xdsl.ir import Attribute

bfloat16 = np.dtype(ml_dtypes.bfloat16)

DTYPE_NAMES = ("bf16", "f32", "i32")
"""The element types a .moe program may declare (comparisons add i1)."""


def numpy_dtype(element_type: Attribute) -> np.dtype:
    """The numpy storage dtype of an xDSL element type."""
    if isinstance(element_type, BFloat16Type):
        return bfloat16
    if isinstance(element_type, Float32Type):
        return np.dtype(np.float32)
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


def compute(x: np.ndarray) -> np.ndarray:
    """The array in its arithmetic type: floats in f32, integers and booleans as they are."""
    if is_float(x.dtype):
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
    return x.astype(dtype)


def sequential_sum(x: np.ndarray, axis: int, keepdims: bool = False) -> np.ndarray:
    """Sum along one axis strictly left to right, in the array's type (f32 rounds at every add,
    i32 wraps): the order in which an engine accumulates over the time axis. Every level sums
    this way, so a reduction gives the same bits before and after lowering (numpy's own sum is
    pairwise along contiguous axes, an order no engine follows)."""
    if x.shape[axis] == 0:
        return np.sum(x, axis=axis, keepdims=keepdims)
    total = np.take(np.add.accumulate(x, axis=axis, dtype=x.dtype), [-1], axis=axis)
    return total if keepdims else np.squeeze(total, axis=axis)
