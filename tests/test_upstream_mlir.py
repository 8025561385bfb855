"""Every example's generic IR, at the graph, lowered and scheduled levels, read by upstream
MLIR's parser (unregistered dialects allowed): tcpc's dialects must not collide with upstream's
(issue #28: the low-precision dialect was `quant`, upstream's quantization dialect, until it
became `lowp`), and its builtin types and the module's `dlti.target_system_spec` are upstream's.

Uses every upstream parser installed (`mlir-opt`, `mlir-opt-NN`, `iree-opt`, or the MLIR Python
bindings of `iree-base-compiler`); skips when there is none (CI). docs/architecture.md, "Upstream
MLIR", says which MLIR version reads which IR: before MLIR 20 the target attribute's syntax
(`"key" = value` entries) and the fp4/e8m0 types are unknown.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

import tcpc
from target.target_spec import TARGET_ATTR
from tcpc.pipelines import FULL_PIPELINE, LOWERED_PIPELINE, PassStep, apply_pipeline, parse_pipeline, pipeline_spec
from tcpc.program import print_ir

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.moe"))
LEVELS = ("graph", "lowered", "scheduled")
FIRST_VERSION_WITH_TCPC_SYNTAX = 20
"""MLIR 20 added f4E2M1FN, f8E8M0FNU and the `"key" = value` syntax of DLTI's target specs."""

UpstreamParser = Callable[[str], str | None]
"""Parses generic IR; returns the first error line, or None when it parses."""


def first_error(diagnostics: str) -> str:
    return next((line for line in diagnostics.splitlines() if "error" in line), diagnostics)


def mlir_opt(executable: str) -> UpstreamParser:
    def parse(text: str) -> str | None:
        done = subprocess.run([executable, "--allow-unregistered-dialect", "-o", "/dev/null", "-"],
                              input=text, capture_output=True, text=True, timeout=60)
        return None if done.returncode == 0 else first_error(done.stderr)
    return parse


def python_bindings() -> UpstreamParser:
    from iree.compiler import ir  # type: ignore[import-not-found]

    context = ir.Context()
    context.allow_unregistered_dialects = True

    def parse(text: str) -> str | None:
        try:
            ir.Module.parse(text, context)
        except ir.MLIRError as e:
            return first_error(str(e))
        return None
    return parse


def upstream_parsers() -> dict[str, tuple[int, UpstreamParser]]:
    """Installed upstream parsers by name, each with its MLIR (LLVM) major version."""
    found: dict[str, tuple[int, UpstreamParser]] = {}
    names = ["mlir-opt", *(f"mlir-opt-{v}" for v in range(17, 30)), "iree-opt"]
    for name in names:
        executable = shutil.which(name)
        if executable is None:
            continue
        version = re.search(r"LLVM version (\d+)", subprocess.run([executable, "--version"], capture_output=True,
                                                                  text=True, timeout=60).stdout)
        if version is not None:
            found[name] = (int(version.group(1)), mlir_opt(executable))
    try:
        from iree.compiler.version import VERSION  # type: ignore[import-not-found]
    except ImportError:
        return found
    if int(VERSION.split(".")[0]) >= 3:  # IREE 3 is built on LLVM 20 or newer; its bindings name no LLVM version
        found["iree.compiler.ir"] = (FIRST_VERSION_WITH_TCPC_SYNTAX, python_bindings())
    return found


PARSERS = upstream_parsers()


@cache
def generic_ir(example: Path) -> dict[str, str]:
    """The example's generic IR at each level, as `tcpc compile --generic` prints it (B = 4 and
    lower-topk's default strategy: the op set, not the tuning, is what upstream must read)."""
    program = tcpc.compile_file(example, {"B": 4})
    texts = {"graph": print_ir(program.module, generic=True)}

    def after(step: PassStep) -> None:
        if step.name == LOWERED_PIPELINE[-1]:
            texts["lowered"] = print_ir(step.module, generic=True)
    scheduled = apply_pipeline(program.module, parse_pipeline(pipeline_spec(FULL_PIPELINE, topk_strategy=None)), after)
    texts["scheduled"] = print_ir(scheduled, generic=True)
    return texts


def without_target(text: str) -> str:
    """The IR without the module's target attribute (MLIR 19 cannot read its syntax)."""
    module = tcpc.load_ir(text).module
    del module.attributes[TARGET_ATTR]
    return print_ir(module, generic=True)


@pytest.fixture(params=sorted(PARSERS) or [None])
def parser(request: pytest.FixtureRequest) -> tuple[int, UpstreamParser]:
    if request.param is None:
        pytest.skip("no upstream MLIR parser installed (mlir-opt, iree-opt or iree-base-compiler's bindings)")
    return PARSERS[request.param]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_upstream_mlir_reads_every_example(parser: tuple[int, UpstreamParser], example: Path, level: str) -> None:
    version, parse = parser
    text = generic_ir(example)[level]
    assert not re.search(r'"quant\.', text), "tcpc's IR must not use upstream's quant dialect"
    if version >= FIRST_VERSION_WITH_TCPC_SYNTAX:
        assert parse(text) is None
        return
    # before MLIR 20: fp4/e8m0 types are unknown and the target attribute's syntax is MLIR 20's;
    # nothing else is
    if "f4E2M1FN" in text or "f8E8M0FNU" in text:
        assert re.search("f4E2M1FN|f8E8M0FNU", failing_line(text, parse(text)))
    else:
        assert TARGET_ATTR in failing_line(text, parse(text))
        assert parse(without_target(text)) is None


def failing_line(text: str, error: str | None) -> str:
    """The line of `text` an upstream parse error points at (`file:line:col: error: ...`)."""
    assert error is not None, "upstream MLIR read IR it is expected to reject"
    line = re.search(r":(\d+):\d+:", error)
    assert line is not None, error
    return text.splitlines()[int(line.group(1)) - 1]
