"""Output files: written atomically, with the mode any file the user writes gets."""

from __future__ import annotations

import errno
import os
import pickle
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


def test_a_link_its_target_a_files_mode_and_a_device_are_written_through(tmp_path: Path) -> None:
    """The rename replaced a symbolic link with a file (the shared target kept the old content), reset a 0640 file to
    the umask's mode, and replaced a character device with a file."""
    (tmp_path / "shared").mkdir()
    target = tmp_path / "shared" / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_text_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    kept.chmod(0o640)
    write_text_atomic(kept, "new")
    assert kept.read_text() == "new" and stat.S_IMODE(kept.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["kept.json", "link.json", "real.json", "shared"]  # no temporary file
    null = tmp_path / "null"  # a /dev/null of our own (root may make one; others skip this part)
    try:
        os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, AttributeError):
        return
    write_text_atomic(null, "nothing")  # written to, as open() would, not replaced by a file
    assert stat.S_ISCHR(null.stat().st_mode)


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


_FULL_DISK = """
import errno, resource, signal, sys
from pathlib import Path
import _distplan_cli
_distplan_cli.starting = True  # as the console script imports the package for `plan`: neither torch nor Lightning (~10 s of CPU)
from lightning_distplan._files import write_text_atomic
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as on a full disk or quota
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
for name in sys.argv[1:]:
    try:
        write_text_atomic(name, "x" * 100_000)
    except Exception as err:
        print(type(err).__name__, isinstance(err, ValueError), isinstance(err, OSError) and errno.errorcode[err.errno], err)
"""


def test_a_write_the_file_system_refuses_is_one_sentence_and_keeps_the_old_file(tmp_path: Path) -> None:
    """A full disk at the write (after minutes of profiling or benchmarking) printed 'OSError: [Errno 28] No space left
    on device' with the generic HINT, naming no file. The sentence that replaced it was a ValueError only, which an
    ``except OSError`` around the write (the usual guard for a full disk) let through; it is an OSError too, with the
    failure's errno."""
    import subprocess
    import sys

    (tmp_path / "profile.json").write_text("old")
    run = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path / "profile.json"), str(tmp_path / "new.json")],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert run.returncode == 0, run.stderr
    first, second = run.stdout.splitlines()
    assert first == (
        f"OutputPathError True EFBIG Writing {str(tmp_path / 'profile.json')!r} failed (File too large); the file there before is left as it was. "
        "HINT: Free space on that file system (or check its quota and permissions), or pick another path."
    )
    assert second.startswith(f"OutputPathError True EFBIG Writing {str(tmp_path / 'new.json')!r} failed (File too large); no file was made. HINT:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json"] and (tmp_path / "profile.json").read_text() == "old"
    if Path("/dev/full").exists():  # a device written in place: no claim about what it holds
        with pytest.raises(OSError, match=r"^Writing '/dev/full' failed \(No space left on device\)\. HINT: Free space") as full:
            write_text_atomic("/dev/full", "{}")
        assert isinstance(full.value, OutputPathError) and full.value.errno == errno.ENOSPC
        assert pickle.loads(pickle.dumps(full.value)).errno == errno.ENOSPC  # as a broadcast to the other ranks has it
