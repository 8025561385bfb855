"""What several test files share: bit-for-bit comparisons, running `tcpc` in process, and a
mesh program's outputs under several pipelines."""

from __future__ import annotations

import numpy as np
import pytest
from xdsl.dialects.builtin import ModuleOp

from runtime_sim.perf.mesh_simulate import simulate_mesh
from target.mesh_machine import load_mesh_machine
from tcpc.arrays import prepare_inputs
from tcpc.cli import main
from tcpc.mesh_run import MeshSpec, split_arguments, token_outputs
from tcpc.program import Program


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


def mesh_outputs(program: Program, spec: MeshSpec, pipelines: list[str | ModuleOp], seed: int) -> list[list[np.ndarray]]:
    """The layer's outputs (every chip's tokens, in order) when every chip runs `program` lowered
    by each of `pipelines` (or a module already lowered), on the inputs of `seed`."""
    fn = program.function(None)
    name = fn.sym_name.data
    args = prepare_inputs(fn, {}, seed)
    machine = load_mesh_machine()
    outputs = []
    for pipeline in pipelines:
        module = program.lower(pipeline) if isinstance(pipeline, str) else pipeline
        result = simulate_mesh(module, name, machine, split_arguments(module, name, spec.mesh, args))
        outputs.append(token_outputs(spec.mesh, result.outputs))
    return outputs


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
