"""What the export side and the server need beyond ``pip install recserve``, and which versions of it
go together (the CLI and the engine ask; installed metadata is read, nothing of it imported).

torchrec and fbgemm are not dependencies of the distribution (pyproject.toml says why), and neither
wheel states the torch it was built for: pip installs any fbgemm next to any torch. fbgemm's
libraries are built against one torch minor version (another one fails to load them, "undefined
symbol"), and torchrec is released with the fbgemm of its own minor version.
"""
from __future__ import annotations

import importlib.metadata
from typing import Optional

STACK = ("torchrec", "fbgemm_gpu", "torch")  # import names
# torch minor version -> the fbgemm and torchrec minor version built for it (FBGEMM's compatibility table)
RELEASES = {"2.11": "1.6", "2.12": "1.7", "2.13": "1.8"}
NEWEST_TORCH = "2.13"
FBGEMM_DISTRIBUTIONS = ("fbgemm-gpu-cpu", "fbgemm-gpu")  # the CPU build, the CUDA build: one import name


def _installed(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def install_hint() -> str:
    """The commands that install fbgemm and torchrec for the torch installed (for the newest torch
    supported, installed first, where there is none or another)."""
    torch = _installed("torch")
    fits = torch is not None and _minor(torch) in RELEASES
    minor = _minor(torch) if fits else NEWEST_TORCH
    first = "" if fits else f"pip install \"torch=={minor}.*\", then "
    return (f"{first}pip install \"fbgemm-gpu-cpu=={RELEASES[minor]}.*\" (\"fbgemm-gpu=={RELEASES[minor]}.*\" with a "
            f"GPU), then pip install --no-deps \"torchrec=={RELEASES[minor]}.*\" (built for torch {minor})")


def not_installed(module: str) -> str:
    return f"this command needs {module}, which is not installed: {install_hint()}"


def mismatch() -> Optional[str]:
    """Which of fbgemm and torchrec was built for another torch than the installed one, and what to
    install instead; None where every one installed fits (a missing one is said where it is imported)."""
    torch = _installed("torch")
    if torch is None or _minor(torch) not in RELEASES:
        return None
    wrong = [f"{name} {version}" for name in (*FBGEMM_DISTRIBUTIONS, "torchrec")
             if (version := _installed(name)) is not None and _minor(version) != RELEASES[_minor(torch)]]
    if not wrong:
        return None
    were = "were" if len(wrong) > 1 else "was"
    # Both builds installed, one stale: installing the fitting one again finds it there and changes nothing.
    both = any(w.startswith("fbgemm") for w in wrong) and all(_installed(name) for name in FBGEMM_DISTRIBUTIONS)
    first = f"pip uninstall -y {' '.join(FBGEMM_DISTRIBUTIONS)} (both are installed, one module: fbgemm_gpu), then " \
        if both else ""
    return f"{' and '.join(wrong)} {were} built for another torch than the installed {torch}: {first}{install_hint()}"
