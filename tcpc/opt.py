"""`tcpc-opt`: xdsl-opt with tcpc's dialects and passes, for golden tests and IR experiments."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from io import BytesIO
from typing import IO, NoReturn

from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass, PassPipeline, PassPipelineCallbackType
from xdsl.utils.exceptions import DiagnosticException, ParseError, PassFailedException, VerifyException
from xdsl.xdsl_opt_main import xDSLOptMain

from tcpc.parser import BOM
from tcpc.pipelines import DIALECTS, PASSES, PipelineError, check_pipeline_syntax
from tcpc.provenance import Snapshot, inherit_locations, snapshot
from tcpc.streams import EXIT_BROKEN_PIPE, OutputError, cannot_write, checked_stdout, discard_stdout, remove_partial



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

    def get_input_stream(self) -> tuple[IO[bytes], str]:
        """The input read whole, without a UTF-8 byte-order mark (as tcpc reads it), and a file
        closed at once: xDSL keeps it open until the run ends, and leaves it open when the
        output then cannot be opened."""
        f, extension = super().get_input_stream()
        try:
            data = f.read()
        finally:
            if f is not sys.stdin.buffer:
                f.close()
        return BytesIO(data.removeprefix(BOM.encode())), extension

    def setup_pipeline(self) -> None:
        """tcpc's syntax checks first: one-line errors for an unclosed brace, an empty pass, an
        option given twice, which xDSL accepts or reports with a BaseException. Each pass's new
        ops inherit source locations, as in `tcpc compile` (tcpc/provenance.py)."""
        if self.args.passes:
            check_pipeline_syntax(self.args.passes)
        super().setup_pipeline()
        self.pipeline = PassPipeline(self.pipeline.passes, locating(self.pipeline.callback))


def locating(callback: PassPipelineCallbackType | None) -> PassPipelineCallbackType:
    """`callback` (xDSL's, which prints the IR after a pass), with each pass's new ops located
    before it runs."""
    before: list[Snapshot] = []

    def between(previous: ModulePass | None, module: ModuleOp, next_pass: ModulePass | None) -> None:
        if previous is not None and before:
            inherit_locations(module, before.pop(), previous.name)
        if callback is not None:
            callback(previous, module, next_pass)
        if next_pass is not None:
            before.append(snapshot(module))

    return between


def main(argv: Sequence[str] | None = None) -> None:
    """Bad IR gets xDSL's located message and exit status 1, never a traceback; so do a file
    that cannot be read and an output that cannot be written (a full disk). A reader of stdout
    that went away ends it quietly, with tcpc's status for that (141)."""
    opt: TcpcOptMain | None = None
    try:
        opt = TcpcOptMain(description="tcpc's modular optimizer driver", args=argv)
        with checked_stdout():
            opt.run()
            sys.stdout.flush()
    except (ParseError, VerifyException, DiagnosticException, PassFailedException, PipelineError) as e:
        fail(str(e))
    except UnicodeDecodeError as e:
        fail(f"the input is not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r})")
    except ValueError as e:  # xDSL's unknown passes and bad options
        fail(str(e))
    except OutputError as e:
        discard_stdout()
        fail(str(e))
    except BrokenPipeError:
        discard_stdout()
        sys.exit(EXIT_BROKEN_PIPE)
    except OSError as e:
        if e.filename is not None:  # the input file, or an -o that cannot be opened
            fail(f"{e.filename}: {(e.strerror or str(e)).lower()}")
        output = opt.args.output_file if opt is not None else None
        if output is not None:  # xDSL writes nothing else
            remove_partial(output)
        fail(cannot_write(output or "the standard output", e))
    except BaseException as e:  # xDSL's ArgSpecParseError is a BaseException
        if type(e).__name__ != "ArgSpecParseError":
            raise
        message = " ".join(line.strip() for line in str(e).splitlines()[-1:])
        fail(f"pass pipeline: {message}")


def fail(message: str) -> NoReturn:
    print(f"tcpc-opt: error: {message}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
    main()
