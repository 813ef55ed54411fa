"""Result provenance: the versions that ran (transformers' when installed) and the git commit of the package's checkout."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_distplan._provenance import code_provenance, git_state, versions

ROOT = Path(__file__).resolve().parents[1]
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(cwd: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def test_versions_name_transformers_when_it_is_installed() -> None:
    import torch

    got = versions()
    assert got["torch"] == torch.__version__ and got["python"] == sys.version.split()[0] and got["lightning_distplan"]
    try:
        installed = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        assert "transformers" not in got
    else:
        assert got["transformers"] == installed


@needs_git
def test_git_state_is_the_checkouts_commit_and_names_uncommitted_changes(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    package = repo / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    (repo / "README").write_text("r\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    head = _git(repo, "rev-parse", "HEAD")
    assert git_state(package) == {"commit": head, "dirty": False, "changed": []}
    (package / "__init__.py").write_text("x = 2\n")  # a tracked change anywhere in the checkout
    assert git_state(package) == {"commit": head, "dirty": True, "changed": ["pkg/__init__.py"]}
    _git(repo, "checkout", "-q", "--", ".")
    (repo / "scratch.txt").write_text("notes")  # untracked outside the package: not code that ran
    assert git_state(package)["dirty"] is False
    (package / "new_module.py").write_text("y = 1\n")  # untracked inside it: code that ran but is in no commit
    assert git_state(package) == {"commit": head, "dirty": True, "changed": ["pkg/new_module.py"]}


@needs_git
def test_git_state_is_absent_outside_a_checkout_of_the_package(tmp_path: Path) -> None:
    plain = tmp_path / "plain" / "pkg"  # an installed copy: no repository around it
    plain.mkdir(parents=True)
    (plain / "__init__.py").write_text("")
    assert git_state(plain) is None
    # a copy inside someone else's checkout that does not track it (a virtual environment in a project folder)
    project = tmp_path / "project"
    project.mkdir()
    (project / "app.py").write_text("")
    _git(project, "init", "-q")
    _git(project, "add", ".")
    _git(project, "commit", "-q", "-m", "app")
    venv_copy = project / "venv" / "site-packages" / "pkg"
    venv_copy.mkdir(parents=True)
    (venv_copy / "__init__.py").write_text("")
    assert git_state(venv_copy) is None


@needs_git
def test_benchmark_results_record_the_code_that_wrote_them(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _results import write_result

    doc = {"benchmark": "b", "value": 1}
    write_result(tmp_path / "r.json", doc)
    written = json.loads((tmp_path / "r.json").read_text())
    assert doc == {"benchmark": "b", "value": 1}  # the caller's dict is left alone
    assert {k: v for k, v in written.items() if k != "code"} == doc
    assert written["code"]["versions"] == versions()
    state = git_state()
    if state is None:  # tests run from an installed copy: nothing to record, and nothing made up
        assert "git" not in written["code"]
    else:
        assert written["code"]["git"]["commit"] == _git(ROOT, "rev-parse", "HEAD") == state["commit"]
        assert written["code"]["git"]["dirty"] == state["dirty"]
    assert code_provenance() == written["code"]


@needs_git
def test_git_state_reads_any_path_and_leaves_the_checkouts_index_alone(tmp_path: Path) -> None:
    """git_state decoded git's output as the locale's text: with core.quotePath=false a file name that is not UTF-8
    raised UnicodeDecodeError, so the bench or benchmark result around it was never written; with the default
    quoting, names came back in git's C quotes ('"pkg/\\303\\251.py"') and a rename as 'old -> new'. It also let
    `git status` refresh the user's index (index.lock taken and the file rewritten), which a concurrent git command
    in that checkout, or the other ranks of a bench doing the same, trip over."""
    repo = tmp_path / "repo"
    package = repo / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("x = 1\n")
    (package / "old.py").write_text("y = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "one")
    head = _git(repo, "rev-parse", "HEAD")
    index = repo / ".git" / "index"
    before = index.read_bytes()
    init = package / "__init__.py"
    os.utime(init, ns=(init.stat().st_atime_ns, init.stat().st_mtime_ns + 5_000_000_000))  # same content, newer stamp
    assert git_state(package) == {"commit": head, "dirty": False, "changed": []}
    assert index.read_bytes() == before  # a plain `git status` rewrites it here to record the new stamp
    (package / "é new.py").write_text("z = 1\n")
    _git(repo, "mv", "pkg/old.py", "pkg/renamed.py")
    assert git_state(package) == {"commit": head, "dirty": True, "changed": ["pkg/old.py", "pkg/renamed.py", "pkg/é new.py"]}
    try:
        (package / os.fsdecode(b"\xe9t\xe9.py")).write_text("")  # a Latin-1 name: not UTF-8
    except (OSError, UnicodeError):
        pytest.skip("this file system takes UTF-8 names only")
    _git(repo, "config", "core.quotePath", "false")
    state = git_state(package)
    assert state is not None and state["dirty"] and len(state["changed"]) == 4 and "pkg/é new.py" in state["changed"]
