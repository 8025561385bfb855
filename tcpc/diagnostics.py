"""Compile errors that point at the source: `file:line:col: error: message`, the line, a caret."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Loc:
    """A 1-based line and column in a source file."""

    line: int
    col: int


class CompileError(Exception):
    """An error in the user's program (or its --set overrides), located when it has a place."""

    def __init__(self, message: str, loc: Loc | None = None):
        super().__init__(message)
        self.message = message
        self.loc = loc

    def render(self, filename: str, source: str) -> str:
        if self.loc is None:
            return f"{filename}: error: {self.message}"
        lines = source.split("\n")  # as the parser counts lines; an empty file has one empty line
        text = f"{filename}:{self.loc.line}:{self.loc.col}: error: {self.message}"
        if 1 <= self.loc.line <= len(lines):
            line = lines[self.loc.line - 1].rstrip("\r")
            caret = "".join(c if c == "\t" else " " for c in line[: self.loc.col - 1]) + "^"
            text += f"\n{line}\n{caret}"
        return text
