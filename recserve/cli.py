"""The ``recserve`` command: export-side and serving-side subcommands under one name.

Each side registers its own subcommands; heavy imports happen only inside the chosen handler.
A :class:`recserve.errors.UserError` becomes one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import warnings
from typing import List, Optional

from recserve import install
from recserve.errors import Interrupted, UserError
from recserve.logs import setup_logging

# The commands that run torch with torchrec and fbgemm (recserve/install.py: what they need)
STACK_COMMANDS = ("train-demo", "export", "serve", "bench", "bench-checkpoint")
# The commands that write files: SIGTERM (as SIGINT) unwinds them, removing what they had half written
WRITING_COMMANDS = ("train-demo", "export", "bench-checkpoint")


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` ends each flag's line with its default, where it has one worth saying."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default in ("", []) or action.required \
                or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """Argument errors in one line, as every other user error (argparse prints the whole usage first);
    a JSON object under --log-format json, found in the arguments before they are parsed."""

    json_errors = False

    def error(self, message: str):
        line = f"{self.prog}: error: {message} (see {self.prog} --help)"
        if Parser.json_errors:
            setup_logging(log_format="json")
            logging.getLogger("recserve.cli").error(line)
            self.exit(2)
        self.exit(2, line + "\n")


def build_parser() -> argparse.ArgumentParser:
    from bench import cli as bench_cli
    from export import cli as export_cli
    from serving import cli as serving_cli

    parser = Parser(prog="recserve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="least severe message logged by recserve's own code (other libraries: WARNING)")
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="json: one JSON object per line (ts, level, logger, message, pid, role), every process")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    export_cli.register(sub)
    serving_cli.register(sub)
    bench_cli.register(sub)
    return parser


def _error(args: argparse.Namespace, line: str) -> None:
    """The one line of a user error: as it is, or as a JSON object under --log-format json."""
    if args.log_format == "json":
        logging.getLogger("recserve.cli").error(line)
    else:
        print(line, file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    Parser.json_errors = any(w == "--log-format=json" or (w == "--log-format" and words[i + 1:i + 2] == ["json"])
                             for i, w in enumerate(words))
    parser = build_parser()
    args = parser.parse_args(argv)
    # Third-party libraries (fbgemm logs every library it loads) stay at WARNING; ours at INFO.
    setup_logging(args.log_level, args.log_format, "supervisor" if args.command == "serve" else "cli")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    handlers = _raise_on_signals() if args.command in WRITING_COMMANDS else {}
    try:
        if args.command in STACK_COMMANDS and (wrong := install.mismatch()):
            raise UserError(wrong)
        return int(args.handler(args) or 0)
    except UserError as e:
        _error(args, f"recserve {args.command}: error: {e}")
        return 2
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in install.STACK:
            raise
        _error(args, f"recserve {args.command}: error: {install.not_installed(e.name.split('.')[0])}")
        return 2
    except Interrupted as e:
        _error(args, f"recserve {args.command}: interrupted by {signal.Signals(e.signum).name}{e.outcome}")
        return 128 + e.signum
    except KeyboardInterrupt:
        return 130
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def _raise_on_signals() -> dict:
    """SIGINT and SIGTERM raise Interrupted (SIGTERM would end the process where it stands, leaving a
    half-written file); returns the handlers they replace (main() may run in a test's process)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def interrupt(signum, frame):
        raise Interrupted(signum)

    return {signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}


if __name__ == "__main__":
    sys.exit(main())
