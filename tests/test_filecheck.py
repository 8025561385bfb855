"""The lit + filecheck golden tests under tests/filecheck, one pytest test per file (its id is
the path under tests/filecheck: `pytest -k lower_topk`), so a failing golden test fails CI and
names its file, its RUN line and filecheck's message."""

import subprocess
import sys
from pathlib import Path

import pytest

from tcpc.pipelines import PASSES

FILECHECK_DIR = Path(__file__).parent / "filecheck"
SUFFIXES = (".mlir", ".moe")  # lit.cfg's config.suffixes
GOLDEN_FILES = sorted(p.relative_to(FILECHECK_DIR).as_posix() for p in FILECHECK_DIR.rglob("*")
                      if p.suffix in SUFFIXES and "Output" not in p.parts)


def test_every_pass_has_golden_files() -> None:
    """The goldens mirror passes/: tests/filecheck/<level>/<pass_module>/ holds golden files for
    every registered pass passes.<level>.<pass_module> (so an empty or misplaced tests/filecheck
    cannot pass by running nothing)."""
    directories = {Path(golden).parent.as_posix() for golden in GOLDEN_FILES}
    wanted = {name: "/".join(PASSES[name]().__module__.split(".")[1:]) for name in PASSES}
    missing = {name: where for name, where in wanted.items() if where not in directories}
    assert not missing, f"no golden files under tests/filecheck/ for {missing}"


@pytest.mark.parametrize("golden", GOLDEN_FILES)
def test_golden_file(golden: str, tmp_path: Path) -> None:
    lit = Path(sys.executable).parent / "lit"
    assert lit.exists(), "lit is not installed: pip install -e '.[test]'"
    result = subprocess.run([str(lit), "-v", "--param", f"exec_root={tmp_path}", str(FILECHECK_DIR / golden)],
                            capture_output=True, text=True)
    output, status = result.stdout + result.stderr, result.returncode
    failure = output.find("******************** TEST")  # lit -v: the RUN lines and their output
    assert status == 0, output[failure:] if failure >= 0 else output
    assert "Passed: 1" in output, output  # lit ran this file, and it passed
