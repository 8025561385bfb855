"""Source locations through every pass (dialects/locations.py, tcpc/provenance.py): the builder
locates every op at its expression, every op a pass creates inherits the location of the op it
lowers, the locations survive the whole pipeline on every example, and `--debug-locations`
prints them in a form tcpc-opt reads back; without the flag the IR is what it was."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from xdsl.dialects.builtin import ModuleOp
from xdsl.parser import Parser

import tcpc
from dialects.locations import created_by, source_locations
from tcpc.opt import main as opt_main
from tcpc.pipelines import FULL_PIPELINE, apply_pipeline, make_context, mesh_pipeline_spec, parse_pipeline, pipeline_spec
from tcpc.program import print_ir

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ENGINE_DIALECTS = ("ve", "tcp", "tile", "lowp", "ccl")
FULL = pipeline_spec(FULL_PIPELINE, topk_strategy="rank", expert_order="block")
"""The full pipeline with its `auto` options fixed: no block or strategy search, so each
example compiles in a fraction of a second."""


def compiled(name: str) -> tcpc.Program:
    """An example at its own dims, its block fixed at 2 (every example's T fits it)."""
    return tcpc.compile_file(EXAMPLES / name, {"B": 2})


def lines_of(op) -> set[int]:
    return {f.line.data for f in source_locations(op.location)}


def unlocated_engine_ops(module: ModuleOp, source: Path) -> list[str]:
    """The engine ops of `module` without a location in `source`, or at a line it does not have."""
    count = len(source.read_text().splitlines())
    return [op.name for op in module.walk() if op.dialect_name() in ENGINE_DIALECTS
            and not (source_locations(op.location) and all(
                f.filename.data == str(source) and 1 <= f.line.data <= count for f in source_locations(op.location)))]


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.moe")))
def test_no_engine_op_is_without_a_location_after_the_full_pipeline(example: str) -> None:
    program = compiled(example)
    lowered = apply_pipeline(program.module, parse_pipeline(FULL))
    assert unlocated_engine_ops(lowered, EXAMPLES / example) == []
    assert any(op.dialect_name() == "tile" for op in lowered.walk())  # the schedule level ran


def test_collectives_of_a_mesh_chip_are_located() -> None:
    program = compiled("mixtral.moe")
    lowered = apply_pipeline(program.module, parse_pipeline(mesh_pipeline_spec(2, 1, 1, "a2a", "rank")))
    assert any(op.dialect_name() == "ccl" for op in lowered.walk())
    assert unlocated_engine_ops(lowered, EXAMPLES / "mixtral.moe") == []


def test_the_builder_locates_each_op_at_its_expression() -> None:
    """`top_p, top_e = topk(probs, K)` on line 7: the op at the call's name; the graph's
    arguments at their parameters; every graph-level op made by no pass."""
    program = compiled("mixtral.moe")
    source = (EXAMPLES / "mixtral.moe").read_text().splitlines()
    for op in program.module.walk():
        if op.name in ("builtin.module",):
            continue
        (leaf,) = source_locations(op.location)
        assert leaf.filename.data == str(EXAMPLES / "mixtral.moe") and created_by(op) == ("builder",)
        text = source[leaf.line.data - 1][leaf.column.data - 1:]
        if op.name == "moe.topk":
            assert (leaf.line.data, text[:5]) == (7, "topk(")
        if op.name == "tmath.div":
            assert text[0] == "/"
    fn = program.function()
    assert [source[a.location.line.data - 1][a.location.column.data - 1:].split(":")[0] for a in fn.body.block.args] \
        == ["x", "router", "w_gate", "w_up", "w_down"]


def test_a_lowering_s_ops_take_the_line_of_the_op_they_lower() -> None:
    """lower-math lowers `sum(top_p)` and the division (line 8) and `bf16(weights)` (line 11) in
    one pass, each into ops that only the next one's ops read: each keeps its own line.
    lower-topk's ops are at the top-k's place, stamped with the pass."""
    program = compiled("mixtral.moe")
    module = apply_pipeline(program.module, parse_pipeline("lower-topk,lower-routing,lower-dispatch,lower-math"))
    by_line: dict[int, list[str]] = {}
    for op in module.walk():
        if op.dialect_name() == "ve" and created_by(op) == ("lower-math",):
            for line in lines_of(op):
                by_line.setdefault(line, []).append(op.name)
    assert {"ve.reduce_sum", "ve.div"} <= set(by_line[8])
    assert by_line[11] == ["ve.narrow"]
    topk = [op for op in module.walk() if created_by(op) == ("lower-topk",)]
    assert topk and all(lines_of(op) == {7} for op in topk)
    assert str(topk[0].location).startswith('loc("lower-topk"(')


def test_the_expert_loop_s_contractions_keep_their_grouped_matmul_s_line() -> None:
    """After the schedule level, the router's contraction is line 6's; the expert loop's (on
    both clusters), the gate and up projections line 10's and the down projection line 11's;
    each made by lower-dispatch, then copied by the schedule's passes."""
    program = compiled("mixtral.moe")
    module = apply_pipeline(program.module, parse_pipeline(FULL))
    contractions = [op for op in module.walk() if op.name == "tcp.contract"]
    assert [sorted(lines_of(op)) for op in contractions] == [[6]] + [[10], [10], [11]] * 2
    assert all(created_by(op)[0] == "lower-dispatch" for op in contractions[1:])
    assert all(created_by(op)[-1] == "split-clusters" for op in contractions[1:])


def test_locations_are_printed_only_when_asked_and_read_back() -> None:
    program = compiled("mixtral.moe")
    module = apply_pipeline(program.module, parse_pipeline(FULL))
    plain = print_ir(module)
    assert "loc(" not in plain
    for generic in (False, True):
        text = print_ir(module, generic, locations=True)
        assert 'loc("lower-dispatch"(' in text
        parsed = Parser(make_context(), text).parse_module()
        assert print_ir(parsed, generic, locations=True) == text
        assert print_ir(parsed) == plain


def test_tcpc_opt_gives_a_pass_s_new_ops_locations(tmp_path: Path) -> None:
    program = compiled("toy.moe")
    graph = tmp_path / "toy.mlir"
    graph.write_text(print_ir(program.module, locations=True))
    out = io.StringIO()
    with redirect_stdout(out):
        opt_main([str(graph), "-p", "lower-topk", "--print-debuginfo"])
    lowered = Parser(make_context(), out.getvalue()).parse_module()
    made = [op for op in lowered.walk() if op.dialect_name() == "ve"]
    assert made and all(created_by(op) == ("lower-topk",) for op in made)
    assert print_ir(lowered, locations=True) == print_ir(
        apply_pipeline(program.module, parse_pipeline("lower-topk")), locations=True)
