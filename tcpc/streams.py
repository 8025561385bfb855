"""The outputs of `tcpc` and `tcpc-opt`: a write that fails is an error, never a success.

Output to a pipe or a file is block-buffered, so a full disk (`> /dev/full`) or a failing stream
shows only when the buffer is flushed, often after the command has printed its last line:
`checked_stdout` routes every write and the final flush through `StandardOutput`, which turns
the failure into an OutputError naming the stream. A reader that went away (`| head`) stays a
BrokenPipeError, which the tools end on quietly. After either, `discard_stdout` points the
stream at /dev/null, so that the interpreter's own flush at exit does not fail again. An output
file whose write failed is removed (`remove_partial`), so no half-written file looks complete.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO


EXIT_BROKEN_PIPE = 141
"""The reader of stdout went away (`tcpc ... | head`): 128 + SIGPIPE, what `tcpc` and
`tcpc-opt` end with, quietly."""


class OutputError(Exception):
    """The standard output cannot be written; the message says why."""


def cannot_write(what: str, e: OSError) -> str:
    return f"cannot write {what}: {(e.strerror or str(e)).lower()}"


class StandardOutput:
    """sys.stdout whose write and flush raise OutputError instead of a bare OSError."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return self._checked(self.stream.write, text)

    def flush(self) -> None:
        self._checked(self.stream.flush)

    @staticmethod
    def _checked(call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise OutputError(cannot_write("the standard output", e)) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextmanager
def checked_stdout() -> Iterator[None]:
    """sys.stdout is a StandardOutput inside the block."""
    saved = sys.stdout
    sys.stdout = StandardOutput(saved)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout = saved


def discard_stdout() -> None:
    """Send what is still buffered for stdout, and anything later, to /dev/null."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def remove_partial(path: str | Path) -> None:
    """Remove an output file whose write failed. Only a regular file: a device or a pipe
    (`/dev/full`, `/dev/stdout`) is not the tool's to delete."""
    target = Path(path)
    if target.is_file():
        try:
            target.unlink()
        except OSError:
            pass
