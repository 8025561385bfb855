"""Reading .npz and .npy files that users give (inputs by name, a routing's expert choices).

numpy reports a damaged file in many ways (EOFError for an empty one, BadZipFile for a truncated
.npz, ValueError for pickles or a bad header, bytes for a member that is no .npy) and leaves the
file open on some; `read_arrays` turns each into one ArrayFileError naming the file, and never
unpickles.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import IO

import numpy as np


_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK\x03\x04"


class ArrayFileError(Exception):
    """An .npz or .npy file that cannot be read; the message names the file (and the array)."""


def read_arrays(path: str | Path) -> np.ndarray | dict[str, np.ndarray]:
    """An .npy file's array, or an .npz file's arrays by name."""
    try:
        with open(path, "rb") as f:  # opened here, so that numpy's failures never leave it open
            return _read(path, f)
    except OSError as e:
        raise ArrayFileError(f"{path}: {(e.strerror or str(e)).lower()}") from None


def _read(path: str | Path, f: IO[bytes]) -> np.ndarray | dict[str, np.ndarray]:
    magic = f.read(len(_NPY_MAGIC))
    f.seek(0)
    if not magic:
        raise ArrayFileError(f"{path}: an empty file, not an .npz or .npy")
    if not magic.startswith((_NPY_MAGIC, _ZIP_MAGIC)):  # numpy would take it for a pickle
        raise ArrayFileError(f"{path}: not an .npz or .npy file")
    try:
        data = np.load(f, allow_pickle=False)
    except zipfile.BadZipFile:  # a zip's magic bytes, but no readable directory
        raise ArrayFileError(f"{path}: a truncated or damaged .npz (not a readable zip file)") from None
    except (ValueError, OSError, EOFError) as e:  # an object array, or a damaged .npy
        raise ArrayFileError(f"{path}: {_unreadable(e)}") from None
    if isinstance(data, np.ndarray):
        return data
    arrays: dict[str, np.ndarray] = {}
    with data:
        for name in data.files:
            try:
                value = data[name]
            except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
                raise ArrayFileError(f"{path}: array '{name}' {_unreadable(e)}") from None
            if not isinstance(value, np.ndarray):  # numpy returns a member that is no .npy as bytes
                raise ArrayFileError(f"{path}: '{name}' is not a numpy array (numpy.savez writes each one as .npy)")
            arrays[name] = value
    return arrays


def _unreadable(e: Exception) -> str:
    """What numpy's error means, in the words of a file or array the user gave."""
    if "Object arrays cannot be loaded" in str(e):  # allow_pickle=False refuses object arrays
        return "holds Python objects (pickled); tcpc reads numeric arrays only"
    return f"cannot be read ({e})" if str(e) else "cannot be read"
