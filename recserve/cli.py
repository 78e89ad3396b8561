"""The ``recserve`` command: export-side and serving-side subcommands under one name.

Each side registers its own subcommands; heavy imports happen only inside the chosen handler.
A :class:`recserve.errors.UserError` becomes one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import logging
import sys
import warnings
from typing import List, Optional

from recserve.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    from bench import cli as bench_cli
    from export import cli as export_cli
    from serving import cli as serving_cli

    parser = argparse.ArgumentParser(prog="recserve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    export_cli.register(sub)
    serving_cli.register(sub)
    bench_cli.register(sub)
    return parser


def _quiet_fbgemm_version_table(record: logging.LogRecord) -> bool:
    # fbgemm_gpu warns once per library (14 times) when its compatibility table lacks the torch
    # version; the version pairs this project supports are tested, so that warning is noise.
    return "_fbgemm_torch_compat_table" not in record.getMessage()


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Third-party libraries (fbgemm logs every library it loads) stay at WARNING; ours at INFO.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_quiet_fbgemm_version_table)
    for name in ("recserve", "export", "serving"):
        logging.getLogger(name).setLevel(args.log_level)
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
