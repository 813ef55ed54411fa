"""What code made a result: package versions and, when the package runs from a git checkout, its commit.

``distplan bench`` and the scripts under ``benchmarks/`` record :func:`code_provenance` in every result
file, so a committed figure can be traced to the code (and the transformers release, for the BERT / GPT-2
models) that measured it.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["versions", "git_state", "code_provenance"]

# packages whose release changes what a run measures; recorded when installed (transformers is an extra)
_OPTIONAL = ("transformers", "torchvision")


def versions() -> dict[str, str]:
    """Versions of Python, torch, lightning, this package and, when installed, transformers and torchvision.

    torch's comes from ``torch.__version__`` (it carries the build: ``2.x.y+cu128``); the optional packages' from
    their installed metadata, so transformers (seconds to import) is not imported to be named."""
    import torch

    import lightning_distplan

    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    try:
        import lightning

        out["lightning"] = lightning.__version__
    except ImportError:
        pass
    out["lightning_distplan"] = getattr(lightning_distplan, "__version__", "unknown")
    for name in _OPTIONAL:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _git(args: list[str], cwd: Path) -> str | None:
    # GIT_OPTIONAL_LOCKS=0: `git status` otherwise rewrites the index (taking index.lock) to refresh it, which a
    # concurrent `git commit` in the user's checkout, or every rank of a bench doing this at once, can trip over.
    # Output is decoded leniently: a path that is not UTF-8 (core.quotePath=false) must not make a result unwritable.
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, stdin=subprocess.DEVNULL, timeout=30,
                              env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.decode("utf-8", errors="replace") if done.returncode == 0 else None


def _status_paths(porcelain_z: str) -> list[str]:
    """The paths of ``git status --porcelain -z``, unquoted: a rename names both paths, a copy its new one."""
    fields = porcelain_z.split("\0")
    paths, i = [], 0
    while i < len(fields):
        entry = fields[i]
        i += 1
        if len(entry) < 4:
            continue
        paths.append(entry[3:])
        if ("R" in entry[:2] or "C" in entry[:2]) and i < len(fields):  # "XY new\0old\0": the old path follows
            if "R" in entry[:2]:
                paths.append(fields[i])
            i += 1
    return paths


def git_state(package_dir: str | Path | None = None) -> dict[str, Any] | None:
    """The commit of the checkout this package runs from, or None when it does not run from one.

    Returns ``{"commit": sha, "dirty": bool, "changed": [paths]}``: ``dirty`` when tracked files differ from the
    commit or untracked files lie in the package's own folder (code that ran but is in no commit); ``changed``
    lists those paths (at most 50), relative to the checkout's root. None when git is missing, the folder is in no
    repository, or the repository around it does not track the package (an installed copy inside someone
    else's checkout, e.g. a virtual environment in a project folder: that project's commit says nothing of it).

    Args:
        package_dir: the package's folder (default: this package's).
    """
    here = Path(package_dir) if package_dir is not None else Path(__file__).resolve().parent
    if _git(["ls-files", "--error-unmatch", "__init__.py"], here) is None:
        return None
    head = _git(["rev-parse", "HEAD"], here)
    tracked = _git(["status", "--porcelain", "-z", "--untracked-files=no"], here)
    untracked = _git(["status", "--porcelain", "-z", "--untracked-files=all", "--", "."], here)
    if head is None or tracked is None or untracked is None:
        return None
    new = [entry for entry in untracked.split("\0") if entry.startswith("??")]
    changed = sorted(set(_status_paths(tracked)) | set(_status_paths("\0".join(new))))
    return {"commit": head.strip(), "dirty": bool(changed), "changed": changed[:50]}


def code_provenance() -> dict[str, Any]:
    """``{"versions": versions(), "git": git_state()}``, ``git`` left out when the package runs from no checkout."""
    out: dict[str, Any] = {"versions": versions()}
    state = git_state()
    if state is not None:
        out["git"] = state
    return out
