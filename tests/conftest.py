"""Suite-wide set-up."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _fits_write_under_a_temporary_root(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Fits whose test gives no default_root_dir (tests/strategies/_tiny_lm.py's trainer_kwargs) write their
    distplan/plan.json here, not into the cwd; the ranks a test starts inherit it."""
    os.environ["DISTPLAN_TEST_ROOT"] = str(tmp_path_factory.mktemp("fits"))
