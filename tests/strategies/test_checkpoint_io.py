"""Checkpoint files are replaced in one step (a temporary file beside them, then a rename), on any file system layout."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from _tiny_lm import TinyLM, trainer_kwargs

from lightning_distplan.errors import OutputPathError
from lightning_distplan.strategies import DPGAStrategy
from lightning_distplan.strategies._checkpoint_io import AtomicCheckpointIO


def test_a_checkpoint_is_replaced_in_one_step_where_tmpdir_is_another_file_system(tmp_path: Path, monkeypatch: Any) -> None:
    """Lightning writes a checkpoint into TMPDIR and moves it onto the path; from a TMPDIR on another file system (a
    tmpfs /tmp, checkpoints on a shared disk) the move copied into the existing file, so a save that failed or was
    stopped there left a half-written last.ckpt in place of the good one (measured: a full disk left 81920 bytes that
    torch.load refused, 'failed finding central directory'), and a process reading the checkpoint read the new one's
    bytes into the old one's."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs a /dev/shm on another file system than the test's folder")
    monkeypatch.setenv("TMPDIR", tempfile.mkdtemp(dir=shm))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    model = TinyLM(n_samples=32, loader_batch=16)
    trainer = L.Trainer(**trainer_kwargs(devices=1), strategy=DPGAStrategy(), max_steps=1)
    trainer.fit(model)
    torch.distributed.destroy_process_group()
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    with open(path, "rb") as reader:  # a resume, an evaluation job or a copy reading the checkpoint
        first = path.stat().st_ino
        model.model.decoder.bias.data += 1
        trainer.save_checkpoint(path)
        assert path.stat().st_ino != first  # a new file took the name: nothing was written into the old one
        old = torch.load(reader, weights_only=True)["state_dict"]
    new = torch.load(path, weights_only=True)["state_dict"]
    torch.testing.assert_close(new["model.decoder.bias"], old["model.decoder.bias"] + 1)
    assert os.listdir(tmp_path) == ["last.ckpt"]

    # A save that fails (here: past the file size limit, as at a full disk or quota) leaves the last one whole.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of ending the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size // 2, hard))
    try:
        model.model.decoder.bias.data += 1
        with pytest.raises(OSError, match=r"^Saving the checkpoint '.*last\.ckpt' failed \(File too large\); the file there "
                           r"before is left as it was\. HINT: Free space on that file system") as failed:
            trainer.save_checkpoint(path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    # an I/O failure: caught by `except OSError` (errno EFBIG, as a full disk's ENOSPC), and by `except ValueError` as before
    assert isinstance(failed.value, OutputPathError) and isinstance(failed.value, ValueError) and failed.value.errno == errno.EFBIG
    torch.testing.assert_close(torch.load(path, weights_only=True)["state_dict"], new, rtol=0, atol=0)
    assert os.listdir(tmp_path) == ["last.ckpt"]


_KILLED_SAVE = """
import os, signal, sys, torch
from lightning_distplan.strategies._checkpoint_io import AtomicCheckpointIO
class KilledWhilePickled:
    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)  # the job ends mid-save (pre-empted, past its time limit)
io = AtomicCheckpointIO()
io.save_checkpoint({"w": torch.zeros(3)}, os.path.join(sys.argv[1], "hpc_ckpt_1.ckpt"))
io.save_checkpoint({"w": torch.zeros(100000), "k": KilledWhilePickled()}, os.path.join(sys.argv[1], "hpc_ckpt_2.ckpt"))
"""


def test_a_killed_save_leaves_no_file_lightning_takes_for_a_checkpoint(tmp_path: Path) -> None:
    """The temporary file a killed save leaves behind was named after the checkpoint ('.hpc_ckpt_2.ckpt.<hex>.tmp'):
    Lightning numbers the HPC checkpoints of a folder by the digits after 'hpc_ckpt_' in any name there, so a SLURM
    requeue resumed from a 'hpc_ckpt_2<digits of the hex>.ckpt' that does not exist (measured:
    'hpc_ckpt_239279239.ckpt') instead of hpc_ckpt_1.ckpt."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(tmp_path)], env=env, capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert len(os.listdir(tmp_path)) == 2  # hpc_ckpt_1.ckpt and the killed save's leftover
    trainer = L.Trainer(default_root_dir=tmp_path, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert trainer._checkpoint_connector._hpc_resume_path == str(tmp_path / "hpc_ckpt_1.ckpt")
    assert trainer._checkpoint_connector.hpc_save_path(tmp_path) == str(tmp_path / "hpc_ckpt_2.ckpt")
    assert torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=True)["w"].shape == (3,)


_SAVE_HELD_OPEN = """
import os, sys, torch
from lightning_distplan.strategies._checkpoint_io import AtomicCheckpointIO
class HeldMidSave:
    def __reduce__(self):
        print("writing", flush=True)
        sys.stdin.readline()  # a large checkpoint still being written when another save in the folder ends
        return (int, (7,))
AtomicCheckpointIO().save_checkpoint({"w": torch.ones(100000), "k": HeldMidSave()}, os.path.join(sys.argv[1], "epoch=1.ckpt"))
"""


def test_a_killed_saves_leftover_goes_at_the_next_save_in_its_folder_but_a_live_save_and_user_files_stay(tmp_path: Path) -> None:
    """A save killed mid-write (SIGKILL: a pre-empted job, its time limit) left its hidden '.distplan-save-<hex>.tmp' in
    the checkpoint folder for good, one per killed save (measured: four killed saves left four, and later saves in the
    folder left them there). The next save in that folder removes it, once its writer is gone (it no longer holds the file's
    lock); a save still being written by another live process, and files of other names, stay."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(tmp_path)], env=env, capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    (killed,) = [p for p in tmp_path.iterdir() if p.name.startswith(".distplan-save-")]
    users = [tmp_path / ".distplan-save-notes.tmp", tmp_path / "draft.tmp", tmp_path / ".distplan-save-0123456789abcdef.tmp.bak"]
    for user in users:
        user.write_text("the user's")
    live = subprocess.Popen([sys.executable, "-c", _SAVE_HELD_OPEN, str(tmp_path)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout is not None and live.stdin is not None
        assert live.stdout.readline() == "writing\n"
        (writing,) = [p for p in tmp_path.glob(".distplan-save-*.tmp") if p != killed and p not in users]
        hour_ago = time.time() - 3600  # long enough: a leftover this young could be a save that has not locked it yet
        for path in [killed, writing, *users]:
            os.utime(path, (hour_ago, hour_ago))

        AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(2)}, tmp_path / "last.ckpt")
        assert not killed.exists()
        assert writing.exists()
        assert all(user.read_text() == "the user's" for user in users)

        live.stdin.write("go on\n")
        live.stdin.close()
        assert live.wait(timeout=60) == 0
    finally:
        live.kill()
        live.wait()
    assert torch.load(tmp_path / "epoch=1.ckpt", weights_only=False)["k"] == 7  # the live save is whole
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hpc_ckpt_1.ckpt", "epoch=1.ckpt", "last.ckpt", *(u.name for u in users)])


_KILLED_AT_A_PROBE = """
import os, signal, sys, torch
from lightning_distplan.strategies._checkpoint_io import AtomicCheckpointIO
def kill_at_probe_removal(event, args):
    if event == "os.remove" and os.path.basename(os.fspath(args[0])).startswith(".distplan-probe."):
        os.kill(os.getpid(), signal.SIGKILL)  # the job ends between the probe's creation and its removal
sys.addaudithook(kill_at_probe_removal)
AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(3)}, os.path.join(sys.argv[1], "ckpts", "last.ckpt"))
"""


def test_a_save_makes_no_probe_file_a_killed_process_could_leave_behind(tmp_path: Path) -> None:
    """Every local save created and removed an empty '.distplan-probe.<hex>' (check_output_path's proof that a file can
    be made there) before its temporary file; a process killed in between left it for good, in the checkpoint folder or,
    before the folder's first save, in its nearest existing parent, where no stale-file cleanup looks. The save's own
    creation of its folder and temporary file is that proof: where it fails (/proc here) the save still says so in one
    sentence, and nothing is made."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _KILLED_AT_A_PROBE, str(tmp_path)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["ckpts", os.path.join("ckpts", "last.ckpt")]
    if Path("/proc/self").is_dir():
        with pytest.raises(OutputPathError, match=r"^Saving the checkpoint '/proc/distplan-none/last\.ckpt' failed \(.+\); no file was "
                           r"made\. HINT: "):
            AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(2)}, "/proc/distplan-none/last.ckpt")


def test_a_checkpoint_path_that_is_a_folder_or_lies_under_a_file_is_refused_in_one_sentence(tmp_path: Path) -> None:
    """A checkpoint path under a file (ModelCheckpoint(dirpath=...) naming a file) raised a bare 'FileExistsError: [Errno
    17] File exists' (or NotADirectoryError) from the folder's creation; a path that is a folder said 'failed (Is a
    directory)' with the hint to free space on the disk."""
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "runs").mkdir()
    cases = {
        tmp_path / "notes.txt" / "last.ckpt": r"lies under '.*notes\.txt', which is a file\.",
        tmp_path / "notes.txt" / "sub" / "last.ckpt": r"lies under '.*notes\.txt', which is a file\.",
        tmp_path / "runs": r"is a directory\.",
    }
    for path, found in cases.items():
        with pytest.raises(OutputPathError, match=rf"^The checkpoint '{path}' {found} HINT: Save checkpoints to a file path in a writable "
                           r"folder \(Trainer\.save_checkpoint\(path\), ModelCheckpoint\(dirpath=\.\.\.\)\)\.$"):
            AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(2)}, path)
    assert (tmp_path / "notes.txt").read_text() == "mine" and list((tmp_path / "runs").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "runs"]


_SAVE_HELD_BEFORE_ITS_RENAME = """
import os, sys, torch
from lightning_distplan.strategies._checkpoint_io import AtomicCheckpointIO
path = os.path.join(sys.argv[1], "last.ckpt")
AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(2)}, path)
chmod = os.chmod
def held(*args, **kwargs):  # the data is written and synced (a large checkpoint's fsync can take minutes); the rename is next
    print("written", flush=True)
    sys.stdin.readline()
    return chmod(*args, **kwargs)
os.chmod = held
AtomicCheckpointIO().save_checkpoint({"w": torch.ones(2)}, path)
"""


def test_a_save_between_its_last_write_and_its_rename_is_not_taken_for_a_killed_ones_leftover(tmp_path: Path) -> None:
    """The writer let go of its temporary file's lock when it closed it, before the rename; a save of another process
    ending in that folder then took the file, its last write over a minute old (a long fsync), for a killed save's
    leftover and removed it, and the live save failed at its rename (FileNotFoundError) with the checkpoint lost."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    live = subprocess.Popen([sys.executable, "-c", _SAVE_HELD_BEFORE_ITS_RENAME, str(tmp_path)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert live.stdout is not None and live.stdin is not None and live.stderr is not None
        assert live.stdout.readline() == "written\n", live.stderr.read()
        (writing,) = tmp_path.glob(".distplan-save-*.tmp")
        hour_ago = time.time() - 3600
        os.utime(writing, (hour_ago, hour_ago))

        AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(2)}, tmp_path / "epoch=1.ckpt")
        assert writing.exists()

        live.stdin.write("go on\n")
        live.stdin.close()
        assert live.wait(timeout=60) == 0, live.stderr.read()
    finally:
        live.kill()
        live.wait()
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["w"].tolist() == [1.0, 1.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=1.ckpt", "last.ckpt"]
