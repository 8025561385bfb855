"""The generated reference (docs/reference/, tcpc/docgen.py) matches the code: regenerated in
memory and compared with the checked-in files, so a changed op, pass option or machine number
fails here until `python -m tcpc.docgen` is run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dialects.moe import TopKOp
from passes.lowering import lower_topk
from passes.schedule.split_clusters import SplitClustersPass
from tcpc import docgen


def test_the_checked_in_reference_is_current() -> None:
    assert not docgen.stale(), f"docs/reference/ is stale: run `{docgen.COMMAND}`"


def test_stale_missing_and_left_over_files_are_named(tmp_path: Path) -> None:
    for name, text in docgen.render().items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    assert docgen.stale(tmp_path) == []
    (tmp_path / "passes.md").write_text("edited by hand\n", encoding="utf-8")
    (tmp_path / "machine.md").unlink()
    (tmp_path / "old-dialect.md").write_text("a renamed dialect's\n", encoding="utf-8")
    assert docgen.stale(tmp_path) == ["machine.md", "old-dialect.md", "passes.md"]


def test_every_registered_dialect_op_and_pass_is_in_the_reference() -> None:
    files = docgen.render()
    for dialect in docgen.own_dialects():
        assert f"\n## {dialect.name}\n" in files["dialects.md"]
        for op in dialect.operations:
            assert f"### `{op.get_irdl_definition().name}`" in files["dialects.md"]
    for name in docgen.PASSES:
        assert f"\n## {name}\n" in files["passes.md"]
    for field in docgen.SCHEMA.values():
        assert f"`[{field.section}] {field.key}`" in files["machine.md"]


def test_an_op_section_states_its_definition() -> None:
    text = "".join(docgen._op_section(TopKOp))
    assert "| property | `k` | IntegerAttr<" in text
    assert "| property | `order` | StringAttr | optional |" in text
    assert "$input attr-dict `:` type($input)" in text
    assert "- k = {k} must be in [1, {shape[-1]}] (the last axis)" in text


def test_every_pass_option_has_a_docstring() -> None:
    """The reference's option table reads the string under each field: a new option without one
    would leave its meaning out."""
    for name, load in docgen.PASSES.items():
        cls = load()
        options = {f.name for f in dataclasses.fields(cls) if f.init}
        missing = options - set(docgen.option_docs(cls))
        assert not missing, f"{name}: options without a docstring under the field: {sorted(missing)}"
    assert docgen.option_docs(SplitClustersPass)["clusters"].startswith("Clusters to spread over")


def test_what_a_pass_consumes_and_produces() -> None:
    assert docgen.consumed_ops(lower_topk) == ["`moe.topk`"]
    removed, introduced = docgen.observed_rewrites()["lower-topk"]
    assert removed == {"moe.topk"} and "ve.filter" in introduced
    removed, introduced = docgen.observed_rewrites()["split-clusters"]
    assert not removed and "tile.copy" in introduced
    assert set(docgen.observed_rewrites()) == set(docgen.PASSES), "OBSERVED_ON must run every pass"


@pytest.mark.parametrize("key, unit", [("clock_hz", "Hz"), ("bytes_per_second", "bytes/s"),
                                       ("bytes_per_cycle", "bytes/cycle"), ("startup_cycles", "cycles"),
                                       ("split_bytes", "bytes"), ("macs_per_cycle_fp8", "MACs/cycle")])
def test_units_follow_from_key_names(key: str, unit: str) -> None:
    assert docgen.unit_of(key) == unit


def test_a_key_without_a_unit_is_an_error_not_a_guess() -> None:
    with pytest.raises(docgen.UnitError, match="'warp_factor': its name says no unit"):
        docgen.unit_of("warp_factor")
