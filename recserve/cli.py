"""The ``recserve`` command: export-side and serving-side subcommands under one name.

Each side registers its own subcommands; heavy imports happen only inside the chosen handler.
A :class:`recserve.errors.UserError` becomes one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from typing import List, Optional

from recserve.errors import UserError
from recserve.logs import setup_logging


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` ends each flag's line with its default, where it has one worth saying."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.required or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from bench import cli as bench_cli
    from export import cli as export_cli
    from serving import cli as serving_cli

    parser = argparse.ArgumentParser(prog="recserve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="json: one JSON object per line (ts, level, logger, message, pid, role), every process")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    export_cli.register(sub)
    serving_cli.register(sub)
    bench_cli.register(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Third-party libraries (fbgemm logs every library it loads) stay at WARNING; ours at INFO.
    setup_logging(args.log_level, args.log_format, "supervisor" if args.command == "serve" else "cli")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    try:
        return int(args.handler(args) or 0)
    except UserError as e:
        print(f"recserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
