"""Destroy the process groups before the interpreter shuts down.

A gloo process group left to interpreter finalization can abort the process ("terminate called without an
active exception", SIGABRT) after a fit that succeeded: its worker threads still hold work objects whose
tensors need the GIL while the interpreter is being torn down (pytorch/pytorch#190489). Lightning destroys
the group at exit for NCCL only; our strategies and PlanningCallback register this for every backend.
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

_registered = False


def destroy_process_groups_at_exit() -> None:
    """Register (once per process) an exit handler that destroys every process group still alive."""
    global _registered
    if not _registered:
        atexit.register(_destroy_process_groups)
        _registered = True


def _destroy_process_groups() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
