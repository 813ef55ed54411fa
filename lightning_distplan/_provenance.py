"""What code made a result: package versions and, when the package runs from a git checkout, its commit.

``distplan bench`` and the scripts under ``benchmarks/`` record :func:`code_provenance` in every result
file, so a committed figure can be traced to the code (and the transformers release, for the BERT / GPT-2
models) that measured it.
"""

from __future__ import annotations

import importlib.metadata
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
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


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
    tracked = _git(["status", "--porcelain", "--untracked-files=no"], here)
    untracked = _git(["status", "--porcelain", "--untracked-files=all", "--", "."], here)
    if head is None or tracked is None or untracked is None:
        return None
    lines = tracked.splitlines() + [line for line in untracked.splitlines() if line.startswith("??")]
    changed = sorted({line[3:] for line in lines})
    return {"commit": head.strip(), "dirty": bool(changed), "changed": changed[:50]}


def code_provenance() -> dict[str, Any]:
    """``{"versions": versions(), "git": git_state()}``, ``git`` left out when the package runs from no checkout."""
    out: dict[str, Any] = {"versions": versions()}
    state = git_state()
    if state is not None:
        out["git"] = state
    return out
