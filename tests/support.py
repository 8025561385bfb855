"""What several test files share: bit-for-bit comparisons, and running `tcpc` in process."""

from __future__ import annotations

import numpy as np
import pytest

from tcpc.cli import main


def bits(a: np.ndarray) -> np.ndarray:
    """The stored bits, so -0.0, NaN payloads and bf16 compare exactly."""
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same_bits(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    """Same count, dtypes, shapes and bytes (NaN payloads and signed zeros included)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


def tcpc_main(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    """`tcpc ARGV...` in process: the exit status, stdout and stderr."""
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def failure(capsys: pytest.CaptureFixture[str], *argv: object, status: int = 1) -> str:
    """Run a command that must fail cleanly (status 1; usage errors 2); its one-line error."""
    code, out, err = tcpc_main(capsys, *argv)
    assert code == status, (out, err)
    assert "Traceback" not in err and "internal error" not in err
    return err
