"""Run a function on N real gloo ranks (CPU) from inside pytest and collect what each returns.

Why not Lightning's own launchers: ``strategy="ddp"`` re-runs ``sys.argv`` (pytest itself) in
child processes, and ``ddp_spawn`` returns only rank 0's result. Instead each rank is a fresh
``spawn`` process with the torchrun environment (MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE)
set; Lightning's ``LightningEnvironment`` then sees ``LOCAL_RANK`` and treats the processes as
launched externally (exactly like ``torchrun``), so a plain
``L.Trainer(accelerator="cpu", devices=N, strategy=...)`` built INSIDE ``fn`` joins the group.
Plain ``torch.distributed`` code can call ``dist.init_process_group("gloo")`` itself.

``fn`` must be importable by the children (a module-level function of a test module or helper),
and its return value picklable (move tensors to CPU). Results come back through ``torch.save``
files, so large state dicts are fine.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader
from _ports import free_port  # noqa: F401 - the strategies' tests import it from here

__all__ = ["run_on_ranks", "free_port", "error_of", "ResumableLoader"]




def error_of(fn: Callable[[], Any]) -> tuple[str, str, list[str]] | None:
    """What ``fn()`` raised on this rank, as ``(type name, message, notes)`` (picklable for the parent), or None."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 — the test compares what every rank raised
        return type(err).__name__, str(err), list(getattr(err, "__notes__", []))
    return None


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    )
    torch.set_num_threads(1)  # 2 shared cores: one thread per rank
    try:
        result: Any = ("ok", fn(rank, world_size, *args, **kwargs))
    except BaseException:  # noqa: BLE001 — sent to the parent, which re-raises
        result = ("error", traceback.format_exc())
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    exit_now()


def exit_now(code: int = 0) -> None:
    """End a worker whose results are saved without the interpreter's shutdown, where torch's gloo teardown can abort
    a process that succeeded ("terminate called without an active exception"; seen in CI even after
    destroy_process_group). What the tests check is in the saved results, never in that teardown."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh processes.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message) or the run timed out.
    """
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, out_dir, fn, args, kwargs), daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        finally:
            alive = [p for p in procs if p.is_alive()]
            for p in alive:  # only the processes started here
                p.kill()
                p.join()
        if alive:
            raise RuntimeError(f"{len(alive)} of {world_size} ranks did not finish within {timeout} s.")
        results = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} exited with code {procs[r].exitcode} and returned nothing.")
            status, value = torch.load(path, weights_only=False)
            if status == "error":
                raise RuntimeError(f"rank {r} failed:\n{value}")
            results.append(value)
        return results


class ResumableLoader(DataLoader):
    """A stateful loader (Lightning saves its state_dict in checkpoints, and restores it on resume): it resumes after
    the batches it had yielded. ``states_given`` counts the state_dict() calls (what reading the state costs a run)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.yielded, self.skip, self.states_given = 0, 0, 0

    def __iter__(self) -> Any:
        skip, self.skip, self.yielded = self.skip, 0, self.skip
        for i, batch in enumerate(super().__iter__()):
            if i >= skip:
                self.yielded += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        self.states_given += 1
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["yielded"]
