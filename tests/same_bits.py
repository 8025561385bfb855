"""Bit-for-bit comparison of a program's outputs, for the tests that run IR before and after a pass."""

import numpy as np


def assert_same_bits(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    """Same count, dtypes, shapes and bytes (NaN payloads and signed zeros included)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
