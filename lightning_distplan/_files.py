"""Output files: refuse a path that cannot be written before the work that fills it, and write
atomically (a temporary file next to the target, then a rename), so a failure never leaves a
half-written file and never replaces the user's own one."""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any, Callable

from lightning_distplan.errors import OutputPathError

__all__ = ["check_output_path", "check_replaceable", "check_replaceable_figure", "save_figure_atomic", "write_text_atomic"]

FIGURE_MARK = "distplan figure"
"""Written into every figure we save (PNG/SVG/PDF metadata, a JPEG comment): a later run may replace such a file."""


def check_output_path(path: str | Path, option: str, *, example: str = "out.json", hint: str | None = None, probe: bool = True) -> Path:
    """``path`` when a file can be written there (its missing parent folders included); else :class:`OutputPathError`.
    ``hint``: the error's HINT in place of the one naming ``option`` (a caller that knows the setting to change).
    ``probe``: create and remove a file where ``path`` will go, which permissions do not tell (a read-only mount, /proc);
    False for a caller whose own file creation there comes next and fails in one sentence (a checkpoint save, frequent:
    a probe its process is killed over stays behind).

    Example:
        >>> check_output_path("runs/x/profile.json", "--out").name
        'profile.json'
    """
    path = Path(path)
    if path.is_dir():
        raise OutputPathError(f"{option} {str(path)!r} is a directory.", hint=hint or f"Name a file, e.g. {option} {path / example}.")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputPathError(
            f"{option} {str(path)!r} lies under {str(ancestor)!r}, which is a file.", hint=hint or f"Pick another path for {option}."
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputPathError(
            f"{option} {str(path)!r} cannot be written: {str(ancestor)!r} is not writable.", hint=hint or f"Pick a writable path for {option}."
        )
    if not probe:
        return path
    # Permissions do not tell a read-only mount or /proc: create (and remove) a file where ours will go.
    probe_file = ancestor / f".distplan-probe.{secrets.token_hex(8)}"
    try:
        os.close(os.open(probe_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError as err:
        raise OutputPathError(
            f"{option} {str(path)!r} cannot be written: creating a file in {str(ancestor)!r} failed ({err.strerror or err}).",
            hint=hint or f"Pick a path on a writable file system for {option}.",
            errno=err.errno,
        ) from None
    probe_file.unlink(missing_ok=True)
    return path


def check_replaceable(path: str | Path, option: str, *, what: str, is_ours: Callable[[Any], bool]) -> None:
    """Refuse to replace an existing file at ``path`` that is not one of ours (``is_ours`` of its JSON).

    ``--out victim.py`` would otherwise replace the user's file with our JSON.
    """
    path = Path(path)
    if not path.is_file():
        return
    try:
        ours = is_ours(json.loads(path.read_text()))
    except (OSError, UnicodeDecodeError, ValueError):
        ours = False
    if not ours:
        raise OutputPathError(
            f"{option} {str(path)!r} exists and is not a {what}; it is left as it is.",
            hint=f"Name a new file for {option} (or delete that one first if you mean to replace it).",
        )


def check_replaceable_figure(path: str | Path, option: str) -> None:
    """Refuse to replace an existing file at ``path`` that is not a figure we saved (:func:`save_figure_atomic`)."""
    path = Path(path)
    if not path.is_file():
        return
    try:
        ours = FIGURE_MARK.encode() in path.read_bytes()
    except OSError:
        ours = False
    if not ours:
        raise OutputPathError(
            f"{option} {str(path)!r} exists and is not a figure distplan saved; it is left as it is.",
            hint=f"Name a new file for {option} (or delete that one first if you mean to replace it).",
        )


def save_figure_atomic(fig: Any, path: str | Path, *, fmt: str | None = None, **savefig_kwargs: Any) -> Path:
    """``fig.savefig`` to ``path`` through a temporary file in the same folder and a rename, marked as ours.

    ``fmt``: the image format; default: from the file's extension (png without one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = fmt or path.suffix.lower().lstrip(".") or "png"
    fmt = "jpeg" if fmt == "jpg" else fmt
    if fmt == "jpeg":
        savefig_kwargs.setdefault("pil_kwargs", {}).setdefault("comment", FIGURE_MARK.encode())
    else:
        savefig_kwargs.setdefault("metadata", {})["Software" if fmt == "png" else "Creator"] = FIGURE_MARK
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    try:
        fig.savefig(tmp, format=fmt, **savefig_kwargs)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a uniquely named temporary file in the same folder and a rename.

    A symbolic link is written through (its target is replaced, the link stays); an existing file keeps its
    permission bits; an existing file that is not a regular one (``/dev/stdout``, a FIFO) is written in place, as
    ``open(path, "w")`` would. A hard link's other names keep the old content (the rename makes a new file).
    """
    path = Path(path)
    try:
        return _write_text_atomic(path, text)
    except OSError as err:  # a full disk or quota at the write, after the work that filled the file (minutes of profiling)
        kept = "; the file there before is left as it was" if path.is_file() else "; no file was made" if not path.exists() else ""
        raise OutputPathError(
            f"Writing {str(path)!r} failed ({err.strerror or err}){kept}.",
            hint="Free space on that file system (or check its quota and permissions), or pick another path.",
            errno=err.errno,
        ) from err


def _write_text_atomic(path: Path, text: str) -> Path:
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    if target.exists() and not target.is_file() and not target.is_dir():
        target.write_text(text, encoding="utf-8")
        return path
    target.parent.mkdir(parents=True, exist_ok=True)
    # A unique name made with mode 0666 less the umask, as open() would (mkstemp's 0600 left the results
    # unreadable to the group on a shared cluster).
    tmp = str(target.parent / f".{target.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:  # plotly's HTML is not ASCII; not the locale's choice
            f.write(text)
        if target.is_file():
            os.chmod(tmp, stat.S_IMODE(target.stat().st_mode))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
