"""Checkpoint files written atomically on every file system layout.

Lightning's ``TorchCheckpointIO`` writes a local checkpoint into a temporary file of the system's temporary folder
(``TMPDIR``) and moves it onto the path. Where that folder lies on another file system than the checkpoint (a tmpfs
``/tmp``, checkpoints on a shared disk: the usual cluster layout) the move is a copy into the existing file, so a save
that fails or is stopped (a full disk or quota, a pre-empted job) leaves a half-written ``last.ckpt`` in place of the
good one; and the temporary folder must hold the whole checkpoint. Here the temporary file lies in the checkpoint's
own folder, and a rename replaces the file in one step.

A save killed mid-write (SIGKILL: a pre-empted job) cannot remove its temporary file. Its writer holds an exclusive
``flock`` on it from its creation to its rename, which the kernel drops when the process dies; each save that succeeds
removes the temporary files of our naming in its folder that no process holds (and that are a minute old, past the
instant between a file's creation and its lock). A save still being written elsewhere, and every other file, stay.

In a multi-process fit global rank 0 alone writes the file. Where that failed (a read-only folder, a full disk, a path
that is a folder) it alone raised the clear error, and the other ranks, waiting in Lightning's barrier after the save,
saw only gloo's "Connection closed by peer" (or waited until the timeout). :meth:`AtomicSaves.save_checkpoint` ends
in one all-reduce that tells every rank whether, and where, the save failed (:func:`raise_on_every_rank`), and every
rank raises that error (Lightning's barrier after the save then finds every rank there). What a strategy adds to the
checkpoint on rank 0 alone before the write (:meth:`AtomicSaves._complete_checkpoint`) fails the same way.

An old checkpoint global rank 0 cannot remove (ModelCheckpoint's ``save_top_k``; a read-only or immutable file) is a
warning there, and every rank trains on (:meth:`AtomicCheckpointIO.remove_checkpoint`): rank 0 alone raised a bare
``PermissionError``, and the others trained on into gloo's "Connection reset by peer". No collective: the file stays,
and a removal some ranks make alone (a callback's, on rank 0) must not wait for the others.
"""

from __future__ import annotations

import os
import pickle
import re
import secrets
import stat
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from typing_extensions import override

from lightning_distplan._files import check_output_path
from lightning_distplan.errors import OutputPathError, first_line

__all__ = ["AtomicCheckpointIO", "AtomicSaves", "raise_on_every_rank"]

_TEMP_NAME = re.compile(r"\.distplan-save-[0-9a-f]{16}\.tmp")
_STALE_AFTER_S = 60.0
"""A temporary file younger than this may be one a live save has made but not locked yet."""
_WRITING: set[str] = set()  # this process's own temporary files (an NFS flock is a POSIX lock, which this process holds)
_WRITING_LOCK = threading.Lock()


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves go through a temporary file beside the checkpoint and a rename (remote
    URLs and ``storage_options`` go to Lightning's own save)."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        fs, local = url_to_fs(str(path))
        if storage_options is not None or not isinstance(fs, LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        _check_checkpoint_path(local)
        folder = os.path.dirname(os.path.abspath(local))
        # Not named after the checkpoint: Lightning reads names in these folders (a killed save's leftover
        # '.hpc_ckpt_2.ckpt.<hex>.tmp' made a SLURM requeue resume from the missing 'hpc_ckpt_2<digits of hex>.ckpt')
        tmp = os.path.join(folder, f".distplan-save-{secrets.token_hex(8)}.tmp")  # _TEMP_NAME
        with _WRITING_LOCK:
            _WRITING.add(tmp)
        try:
            # The folder's creation and this file's are what prove the folder writable (a read-only mount, /proc): no
            # probe file first, which a process killed between its creation and removal left behind at every save
            os.makedirs(folder, exist_ok=True)
            # 0666 less the umask, as open() makes a file; an existing checkpoint's own bits are kept below
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            with os.fdopen(fd, "wb") as f:
                _lock(f.fileno())  # held until the file is renamed and closed, or its writer dies
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())  # the data is on the disk before the name points at it
                if os.path.isfile(local) and not os.path.islink(local):
                    os.chmod(tmp, stat.S_IMODE(os.stat(local).st_mode))
                # Still open, so still locked: unlocked, a file whose last write is a minute old (a long fsync) is
                # another save's cleanup's to remove. A link at the path is replaced, not the checkpoint it points at
                os.replace(tmp, local)
        except BaseException as err:
            if os.path.exists(tmp):
                os.remove(tmp)
            failed = _os_error(err)  # torch's writer raises its own RuntimeError over the file's OSError (a full disk)
            if failed is None:
                raise
            kept = "the file there before is left as it was" if os.path.isfile(local) else "no file was made"
            raise OutputPathError(
                f"Saving the checkpoint {str(path)!r} failed ({failed.strerror or failed}); {kept}.",
                hint="Free space on that file system (or check its quota and permissions), or save checkpoints elsewhere "
                "(ModelCheckpoint(dirpath=...)).",
                errno=failed.errno,
            ) from err
        finally:
            with _WRITING_LOCK:
                _WRITING.discard(tmp)
        _remove_stale_temp_files(folder)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        """Lightning's, where a file that cannot be removed (ModelCheckpoint's top-k removal of an old checkpoint: a
        read-only or immutable file, a folder the process may not change) is a warning and the fit goes on: it raised
        a bare ``PermissionError`` on global rank 0 alone, the rank that removes files (so the warning is that rank's)."""
        try:
            super().remove_checkpoint(path)
        except OSError as err:
            warnings.warn(
                f"Removing the old checkpoint {str(path)!r} failed ({err.strerror or err}), so it is left in place and "
                "training goes on. HINT: Let this process delete files in that folder (its permissions; a read-only or "
                "immutable file), or keep every checkpoint (ModelCheckpoint(save_top_k=-1)).",
                UserWarning,
                stacklevel=2,
            )


def _check_checkpoint_path(path: str) -> None:
    """Refuse a path that is a folder, lies under a file or in a folder its permissions keep us out of, before the
    folder's creation raises a bare ``FileExistsError`` (a ``ModelCheckpoint(dirpath=...)`` naming a file). No probe
    file: the save's own creation of its folder and temporary file comes next and fails in one sentence."""
    hint = "Save checkpoints to a file path in a writable folder (Trainer.save_checkpoint(path), ModelCheckpoint(dirpath=...))."
    check_output_path(path, "The checkpoint", example="last.ckpt", hint=hint, probe=False)


def _lock(fd: int) -> bool:
    """Whether an exclusive ``flock`` on ``fd`` was had, without waiting (False: another process holds it, or this file
    system has no flock)."""
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (ImportError, OSError):  # not POSIX; a file system without flock: a save goes on, nothing is removed
        return False
    return True


def _remove_stale_temp_files(folder: str) -> None:
    """Remove the temporary files of killed saves in ``folder``: our naming, a regular file, no process holding its lock,
    older than :data:`_STALE_AFTER_S`. Best effort: a file that cannot be opened or locked stays."""
    try:
        names = [n for n in os.listdir(folder) if _TEMP_NAME.fullmatch(n)]
    except OSError:
        return
    for name in names:
        path = os.path.join(folder, name)
        with _WRITING_LOCK:
            if path in _WRITING:
                continue
        try:
            # Open for writing (an NFS flock needs it), never following a link; nothing is written
            fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and time.time() - st.st_mtime > _STALE_AFTER_S and _lock(fd):
                if os.path.samestat(st, os.stat(path, follow_symlinks=False)):
                    os.remove(path)
        except OSError:
            pass
        finally:
            os.close(fd)


def _os_error(err: BaseException | None) -> OSError | None:
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def raise_on_every_rank(
    failure: Exception | None, *, doing: str, device: Any = None, skipped: bool | None = None,
    mixed: Callable[[int], Exception] | None = None, also: Sequence[int] = (),
    sent: Callable[[Exception, int], Exception] | None = None,
) -> list[int]:
    """Collective over the default group (every rank calls it): raise on every rank the error one rank had ``doing``
    something only some ranks do or that fails on some only (global rank 0's checkpoint write, a file one node lacks).
    A rank that failed raises its own error; the others raise the lowest failing rank's, with a note naming that rank.
    One all-reduce of three numbers (and ``also``) when nothing failed; the error travels only when one did. Not
    distributed, or one rank: ``failure`` is raised as it is. ``device``: where the all-reduce's tensor lies (the strategy's
    ``root_device``: a GPU under NCCL). ``skipped``: whether this rank had nothing to do (a resume that came to no file on
    it); where some ranks skipped and others did not and none failed, every rank raises ``mixed(lowest skipping rank)``.
    ``also``: integers of the caller's, reduced by MIN in the same all-reduce and returned where nothing was raised (so a
    caller agrees on more without a collective of its own: negate one to have its MAX); ``also`` itself on one rank.
    ``sent``: what the failing rank sends the others in place of its error, given the error and its rank (the error
    itself by default)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        if failure is not None:
            raise failure
        return list(also)
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cpu") if device is None else torch.device(device)
    # MIN of: the lowest failing rank, the lowest skipping rank, and -1 where some rank did what the others skipped
    mine = [world if failure is None else rank, rank if skipped else world, -1 if skipped is False else 0, *also]
    first = torch.tensor(mine, dtype=torch.int64, device=device)
    try:
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
    except RuntimeError:  # a peer gone or a timeout: this rank's own error says more than gloo's
        if failure is not None:
            raise failure from None
        raise
    src, skipper, did, *agreed = (int(v) for v in first.tolist())
    if src == world:
        if skipper < world and did < 0 and mixed is not None:
            raise mixed(skipper)
        return agreed
    box = [_sendable(failure if sent is None else sent(failure, rank)) if rank == src else None]
    dist.broadcast_object_list(box, src=src, device=device if device.type == "cuda" else None)
    if failure is not None:
        raise failure
    err = box[0]
    err.add_note(f"Raised on global rank {src} {doing}; global rank {rank} stops with it.")
    raise err


def _sendable(err: BaseException) -> BaseException:
    """``err`` where it survives pickling (the broadcast to the other ranks), else a ``RuntimeError`` with its first line."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # an exception class whose __init__ pickling cannot call again, a lock in its attributes
        return RuntimeError(f"{type(err).__name__}: {first_line(err)}")
    return err


class AtomicSaves:
    """Mixin for a Lightning strategy whose ``checkpoint_io`` is :class:`AtomicCheckpointIO` where Lightning puts its
    default ``TorchCheckpointIO`` (no plugin given, or a wrapping one such as ``AsyncCheckpointIO`` without its own):
    checkpoints are written atomically also where TMPDIR is another file system. Put it before the Lightning base.

    Its :meth:`save_checkpoint` raises on every rank the error global rank 0's write raised (see the module
    docstring); its :meth:`setup_environment` makes a rank that resumes from no file join the all-reduce of the ranks
    that read one (:func:`~lightning_distplan.strategies._checkpoint.join_resume_reads`)."""

    _checkpoint_io: CheckpointIO | None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """:meth:`_complete_checkpoint` and Lightning's save (global rank 0 writes the file), then every rank raises the
        error either raised, if any."""
        failure = None
        try:
            self._complete_checkpoint(checkpoint)
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]
        except Exception as err:  # not a KeyboardInterrupt: no collective then
            failure = err
        raise_on_every_rank(failure, doing="saving the checkpoint", device=self.root_device)  # type: ignore[attr-defined]

    def _complete_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add to ``checkpoint`` before its write what only some ranks add (a pipeline's by-name optimizer state, on
        global rank 0, which alone holds the gathered state): an error raised here reaches every rank as the write's
        does. Nothing here."""

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        from lightning_distplan.strategies._checkpoint import join_resume_reads  # it imports this module

        module = self.lightning_module  # type: ignore[attr-defined]
        if module is not None and module._trainer is not None:
            join_resume_reads(module._trainer)

    @property
    def checkpoint_io(self) -> CheckpointIO:
        io = self._checkpoint_io
        if io is None:
            io = self._checkpoint_io = AtomicCheckpointIO()
        elif isinstance(io, _WrappingCheckpointIO) and not io._base_checkpoint_io_configured:
            io.checkpoint_io = AtomicCheckpointIO()  # the setter hands it to the innermost wrapper
        return io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io
