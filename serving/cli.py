"""Serving-side subcommands: ``serve``, ``predict``."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    pass
