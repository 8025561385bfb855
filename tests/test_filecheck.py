"""Run the lit + filecheck golden tests as part of pytest, so a failing golden test fails CI."""

import subprocess
import sys
from pathlib import Path

FILECHECK_DIR = Path(__file__).parent / "filecheck"


def test_golden_tests_pass() -> None:
    lit = Path(sys.executable).parent / "lit"
    result = subprocess.run(
        [str(lit), "-v", "--order=lexical", str(FILECHECK_DIR)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
    assert "Passed" in result.stdout
