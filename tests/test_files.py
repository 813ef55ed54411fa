"""Output files: written atomically, with the mode any file the user writes gets."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lightning_distplan._files import check_output_path, write_text_atomic
from lightning_distplan.errors import OutputPathError


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_file_follows_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    old = os.umask(umask)
    try:
        path = write_text_atomic(tmp_path / "sub" / "plan.json", "{}")
    finally:
        os.umask(old)
    assert path.read_text() == "{}" and stat.S_IMODE(path.stat().st_mode) == mode
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]  # no temporary file left behind


def test_profile_out_never_replaces_a_file_that_is_not_a_profile(tmp_path, capsys):
    """`distplan profile --out victim.py` replaced the user's source file with JSON."""
    from lightning_distplan.cli import main

    victim = tmp_path / "victim.py"
    victim.write_text("print('mine')\n")
    rc = main(["profile", "lightning.pytorch.demos.boring_classes:BoringModel", "--out", str(victim), "--repeats", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "exists and is not a profile JSON; it is left as it is" in err[0] and "HINT" in err[0]
    assert victim.read_text() == "print('mine')\n"


def test_an_output_path_where_no_file_can_be_made_is_refused_up_front(tmp_path):
    """/proc lets root "write" by permission bits, but no file can be created there: said before any work,
    not as a FileNotFoundError about our temporary file after it."""
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc on this system")
    with pytest.raises(OutputPathError, match=r"--out '/proc/x.json' cannot be written: .*'/proc'.*HINT"):
        check_output_path("/proc/x.json", "--out")
    assert check_output_path(tmp_path / "new" / "p.json", "--out") == tmp_path / "new" / "p.json"
    assert list(tmp_path.iterdir()) == []  # the probe left nothing behind, and made no folder
