"""`tcpc-opt`: xdsl-opt with tcpc's dialects and passes, for golden tests and IR experiments."""

from __future__ import annotations

import sys

from xdsl.utils.exceptions import DiagnosticException, ParseError, PassFailedException, VerifyException
from xdsl.xdsl_opt_main import xDSLOptMain

from tcpc.pipelines import DIALECTS, PASSES


class TcpcOptMain(xDSLOptMain):
    def register_all_dialects(self) -> None:
        super().register_all_dialects()
        for dialect in DIALECTS:
            if dialect.name not in self.ctx.registered_dialect_names:
                self.ctx.register_dialect(dialect.name, lambda d=dialect: d)

    def register_all_passes(self) -> None:
        super().register_all_passes()
        for name, factory in PASSES.items():
            self.register_pass(name, factory)


def main() -> None:
    """Bad IR gets xDSL's located message and exit status 1, never a traceback."""
    try:
        TcpcOptMain(description="tcpc's modular optimizer driver").run()
    except (ParseError, VerifyException, DiagnosticException, PassFailedException) as e:
        print(f"tcpc-opt: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
