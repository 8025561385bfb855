"""`tcpc-opt`: xdsl-opt with tcpc's dialects and passes, for golden tests and IR experiments."""

from __future__ import annotations

import sys

from xdsl.utils.exceptions import DiagnosticException, ParseError, PassFailedException, VerifyException
from xdsl.xdsl_opt_main import xDSLOptMain

from tcpc.pipelines import DIALECTS, PASSES, PipelineError, check_pipeline_syntax


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

    def setup_pipeline(self) -> None:
        """tcpc's syntax checks first: one-line errors for an unclosed brace, an empty pass, an
        option given twice, which xDSL accepts or reports with a BaseException."""
        if self.args.passes:
            check_pipeline_syntax(self.args.passes)
        super().setup_pipeline()


def main() -> None:
    """Bad IR gets xDSL's located message and exit status 1, never a traceback."""
    try:
        TcpcOptMain(description="tcpc's modular optimizer driver").run()
    except (ParseError, VerifyException, DiagnosticException, PassFailedException, PipelineError) as e:
        print(f"tcpc-opt: error: {e}", file=sys.stderr)
        sys.exit(1)
    except UnicodeDecodeError as e:
        print(f"tcpc-opt: error: the input is not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r})",
              file=sys.stderr)
        sys.exit(1)
    except ValueError as e:  # xDSL's unknown passes and bad options
        print(f"tcpc-opt: error: {e}", file=sys.stderr)
        sys.exit(1)
    except BaseException as e:  # xDSL's ArgSpecParseError is a BaseException
        if type(e).__name__ != "ArgSpecParseError":
            raise
        message = " ".join(line.strip() for line in str(e).splitlines()[-1:])
        print(f"tcpc-opt: error: pass pipeline: {message}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
