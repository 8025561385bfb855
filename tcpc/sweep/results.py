"""Sweep results: the rows as an Arrow table, written as Parquet and CSV, read back for a rerun."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tcpc.sweep.points import CORE_SCHEMA
from tcpc.sweep.spec import EXTRA, SweepError



RESULTS = "results.parquet"
RESULTS_CSV = "results.csv"


def _arrow() -> Any:
    try:
        import pyarrow
        import pyarrow.csv
        import pyarrow.parquet
    except ImportError:
        raise SweepError(f"tcpc sweep writes Parquet with pyarrow: {EXTRA}") from None
    return pyarrow


GROUPS = ("dim.", "machine.", "pass.", "phase.")
"""The prefixes of the columns after the core ones, in the order they are written."""


def _column_order(name: str) -> tuple[int, str]:
    prefix = name.split(".")[0] + "."
    return (GROUPS.index(prefix) if prefix in GROUPS else len(GROUPS), name)


def to_table(rows: Sequence[Mapping[str, Any]]) -> Any:
    pa = _arrow()
    core = dict(CORE_SCHEMA)
    extra = sorted({k for r in rows for k in r} - set(core), key=_column_order)
    fields = [pa.field(name, getattr(pa, t)()) for name, t in CORE_SCHEMA]
    columns = [pa.array([r.get(name) for r in rows], type=f.type) for name, f in zip(core, fields)]
    for name in extra:
        values = [r.get(name) for r in rows]
        given = [v for v in values if v is not None and not isinstance(v, bool)]
        if name.startswith("phase.") or all(isinstance(v, int) for v in given):
            column = pa.array(values, type=pa.int64())
        elif all(isinstance(v, (int, float)) for v in given):
            column = pa.array([None if v is None else float(v) for v in values], type=pa.float64())
        else:
            column = pa.array([None if v is None else str(v) for v in values], type=pa.string())
        fields.append(pa.field(name, column.type))
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def write_results(rows: Sequence[Mapping[str, Any]], out: Path) -> None:
    """results.parquet and results.csv, each written whole and then moved into place."""
    pa = _arrow()
    out.mkdir(parents=True, exist_ok=True)
    table = to_table(rows)
    for name, write in ((RESULTS, pa.parquet.write_table), (RESULTS_CSV, pa.csv.write_csv)):
        tmp = out / f".{name}.tmp"
        write(table, str(tmp))
        os.replace(tmp, out / name)


def read_results(out: Path) -> list[dict[str, Any]]:
    """The rows of an earlier run (none when there is no results file)."""
    path = out / RESULTS
    if not path.exists():
        return []
    pa = _arrow()
    try:
        return pa.parquet.read_table(str(path)).to_pylist()
    except Exception as e:  # pyarrow's errors have no common base
        raise SweepError(f"{path}: cannot read the earlier results ({e}); move it away to start over") from None


# ---------------------------------------------------------------- running
