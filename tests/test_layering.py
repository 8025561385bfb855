"""The layering contract (pyproject.toml, `[tool.importlinter]`; README.md#layout) holds: tcpc ->
(passes | runtime_sim.perf) -> runtime_sim.semantics -> dialects, and nothing imports the
benchmark scripts. import-linter follows every import, function-level ones included, so a
lower layer reaching up (even through a third module) fails here with the import chain."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_imports_follow_the_layers() -> None:
    lint_imports = Path(sys.executable).parent / "lint-imports"
    assert lint_imports.exists(), "import-linter is not installed: pip install -e '.[test]'"
    # This tree's packages, not whatever else is installed under the same names.
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    result = subprocess.run([str(lint_imports), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
                            capture_output=True, text=True)
    report, status = result.stdout + result.stderr, result.returncode
    broken = report.find("Broken contracts")
    assert status == 0, report[broken:] if broken >= 0 else report
    assert " kept, 0 broken." in report
