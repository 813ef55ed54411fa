"""Suite-wide set-up."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_ORIGINAL_TMPDIR = os.environ.get("TMPDIR")
_SUITE_TMPDIR: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    """The suite's temporary files (ours, torch's, the ranks' it starts) go to one folder removed at the end: CI
    shares its disk, and folders that torchrun or a library keep would pile up there run after run. pytest's own
    tmp_path folders stay where pytest keeps them (its last three runs, for looking at a failure)."""
    global _SUITE_TMPDIR
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    _SUITE_TMPDIR = tempfile.mkdtemp(prefix="distplan-tests-")
    os.environ["TMPDIR"] = _SUITE_TMPDIR
    tempfile.tempdir = None  # read TMPDIR again


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SUITE_TMPDIR is None:
        return
    if _ORIGINAL_TMPDIR is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = _ORIGINAL_TMPDIR
    tempfile.tempdir = None
    shutil.rmtree(_SUITE_TMPDIR, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def _fits_write_under_a_temporary_root(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Fits whose test gives no default_root_dir (tests/strategies/_tiny_lm.py's trainer_kwargs) write their
    distplan/plan.json here, not into the cwd; the ranks a test starts inherit it."""
    os.environ["DISTPLAN_TEST_ROOT"] = str(tmp_path_factory.mktemp("fits"))
