"""Where a benchmark script writes its result file.

Most scripts here write, by default, the committed result under ``benchmarks/results/`` that the
README's accuracy table is made from: running one again regenerates that evidence.
:func:`result_path` is called before the measurements start. It refuses a path that cannot be
written, or an existing file that is not a result of these scripts (:func:`is_result`), with one line and a HINT (not a traceback
after minutes of measuring), and when no ``--out`` was given and the default file exists it says,
before the run, that the run will replace it and how to keep it. :func:`write_result` replaces the
file atomically (recording the code's versions and git commit), so a run stopped while writing never leaves half a
result. :func:`read_sweep` reads a CPU cluster sweep's result for the scripts that replay or summarise one, and refuses any other file in one line;
:func:`read_sweeps` reads the files those scripts are given, a stopped sweep's partial file left out.

It imports ``lightning_distplan`` (torch, lightning) only where it writes, so a script that only reads stays light.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

__all__ = ["is_result", "result_path", "figure_path", "write_result", "read_sweep", "read_sweeps", "shown", "positive_ints"]
SWEEP_SCHEMA = "distplan-cpu-cluster-sweep/1"
# examples/auto_plan_overhead.py writes it into benchmarks/results/ (with a check of its own)
RESULT_SCHEMAS = (SWEEP_SCHEMA, "distplan-auto-plan-overhead/1")


def positive_ints(text: str) -> list[int]:
    """An argparse ``type`` for a comma-separated list of positive integers ("1,4"); a bad one is argparse's one-line error."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        import argparse

        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers (e.g. 1,4)")
    return values


def shown(path: Path) -> str:
    """``path`` relative to the repository root where it lies in it (as the scripts' docstrings name files)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _committed(path: Path) -> bool:
    """Whether git tracks ``path`` in this repository (False where git or the repository is missing)."""
    try:
        done = subprocess.run(["git", "ls-files", "--error-unmatch", str(path.resolve())], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return False
    return done.returncode == 0


def is_result(doc: object) -> bool:
    """Whether ``doc`` (a parsed JSON file) is a result these scripts write: a ``"benchmark"`` name, one of our result
    ``"schema"`` names, or a ``"provenance"`` with the ``"command"`` that made it.

    Every committed result under ``benchmarks/results/`` (``earlier/`` too) has one of the three; no one key is in all of
    them. Any JSON object passed before, so ``--out package.json`` or ``--out runs/distplan/profile.json`` was replaced
    without a word."""
    if not isinstance(doc, dict):
        return False
    provenance = doc.get("provenance")
    return (isinstance(doc.get("benchmark"), str) or doc.get("schema") in RESULT_SCHEMAS
            or (isinstance(provenance, dict) and isinstance(provenance.get("command"), str)))


def result_path(out: str | Path | None, default: str | Path, *, script: str, option: str = "--out", now: bool = False) -> Path:
    """The file to write: ``out`` when given, else ``default``; refused with one line (``SystemExit``) when it
    cannot be written or is an existing file other than a result of these scripts (:func:`is_result`). With ``out`` not given and ``default``
    present, prints (stderr) that the run replaces it when it ends (``now``: that it is being replaced, for a run
    that writes as it goes and learns the default's name only then, too late to keep the file with ``option``)."""
    from lightning_distplan._files import check_output_path, check_replaceable
    from lightning_distplan.errors import OutputPathError

    path = Path(out if out is not None else default)
    try:
        check_output_path(path, option, example=Path(default).name)
        check_replaceable(path, option, what="JSON result file", is_ours=is_result)
    except OutputPathError as err:
        raise SystemExit(f"{script}: {err}") from None
    if out is None and path.is_file():
        what = "the committed result" if _committed(path) else "the result file"
        restore = f"git checkout -- {shown(path)} restores it" if what == "the committed result" else ""
        if now:
            told = f"this run is replacing {what} {shown(path)} (it writes after each part)" + (f"; {restore}." if restore else ".")
        else:
            told = f"this run replaces {what} {shown(path)} when it ends; pass {option} FILE to keep it" + (f" ({restore})." if restore else ".")
        print(f"{script}: {told}", file=sys.stderr, flush=True)
    return path


def figure_path(out: str | Path, *, script: str, option: str) -> Path:
    """``out`` when a figure can be written there; else ``SystemExit`` with one line (before the run, not after it).

    An existing file is replaced only when it is a figure distplan saved (:func:`~lightning_distplan._files.save_figure_atomic`
    marks them) or a committed one (git restores it; the committed figures predate the mark): ``--figure photo.png``
    would otherwise replace the user's picture."""
    from lightning_distplan._files import check_output_path, check_replaceable_figure
    from lightning_distplan.errors import OutputPathError

    try:
        path = check_output_path(out, option, example="figure.png")
        if not _committed(path):
            check_replaceable_figure(path, option)
    except OutputPathError as err:
        raise SystemExit(f"{script}: {err}") from None
    return path


def write_result(path: str | Path, doc: dict, *, indent: int = 1) -> Path:
    """``doc`` as JSON to ``path`` through a temporary file and a rename (never half written), with the code that made
    it under ``"code"`` (:func:`~lightning_distplan._provenance.code_provenance`: package versions, transformers' when
    installed, and the git commit when the package runs from a checkout, with its uncommitted changes named).

    ``doc`` itself is not changed. Result files written before 2026-11-29 have no ``"code"``; readers must not need it."""
    from lightning_distplan._files import write_text_atomic
    from lightning_distplan._provenance import code_provenance

    return write_text_atomic(path, json.dumps({**doc, "code": code_provenance()}, indent=indent) + "\n")


def read_sweep(path: str | Path, *, script: str) -> dict:
    """The result of ``cpu_cluster_sweep.py`` at ``path``; ``SystemExit`` with one line for a missing file or another file."""
    hint = "HINT: pass sweep results written by benchmarks/cpu_cluster_sweep.py, e.g. benchmarks/results/cpu_cluster_sweep*.json."
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"{script}: {path} does not exist. {hint}") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise SystemExit(f"{script}: {path} cannot be read as JSON ({type(err).__name__}: {str(err).splitlines()[0]}). {hint}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SWEEP_SCHEMA or not isinstance(doc.get("settings"), list):
        raise SystemExit(f"{script}: {path} is not a CPU cluster sweep result ({SWEEP_SCHEMA}). {hint}")
    return doc


def read_sweeps(paths: list[str | Path], *, script: str) -> list[tuple[Path, dict]]:
    """The sweep results at ``paths`` (:func:`read_sweep`), each with its path, less the partial files of stopped sweeps.

    A sweep stopped part-way writes ``<out>.partial.json`` (``.partial.2.json``, ...) beside its ``--out``, so the
    documented ``benchmarks/results/cpu_cluster_sweep*.json`` matches it too: its settings are no sweep's result (a
    setting that was stopped, no summary), and pooled with the committed runs they would count twice or half-measured.
    Each one left out is named on stderr; ``SystemExit`` with one line when no sweep is left."""
    docs = []
    for path in paths:
        doc = read_sweep(path, script=script)
        if "stopped" in doc:  # only cpu_cluster_sweep.py's stopped runs write it
            print(f"{script}: left out {path}, a stopped sweep's partial file ({doc['stopped']}).", file=sys.stderr, flush=True)
            continue
        docs.append((Path(path), doc))
    if not docs:
        raise SystemExit(f"{script}: every file given is a stopped sweep's partial file, which is no sweep's result. "
                         "HINT: pass sweep results written by benchmarks/cpu_cluster_sweep.py, e.g. benchmarks/results/cpu_cluster_sweep.json.")
    return docs
