"""Output files: written atomically, with the mode any file the user writes gets."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lightning_distplan._files import write_text_atomic


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_file_follows_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    old = os.umask(umask)
    try:
        path = write_text_atomic(tmp_path / "sub" / "plan.json", "{}")
    finally:
        os.umask(old)
    assert path.read_text() == "{}" and stat.S_IMODE(path.stat().st_mode) == mode
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]  # no temporary file left behind
