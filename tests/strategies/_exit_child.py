"""One short fit under ``torchrun``, recording at interpreter exit whether a process group was still alive.

Run by test_process_groups_destroyed_at_exit: ``torchrun --nproc-per-node N _exit_child.py WHICH OUT``.
Each rank writes ``OUT.<rank>`` ("alive" or "destroyed") from an exit handler registered before the fit, so
it runs after every handler the fit registers (atexit runs them in reverse order).
"""

from __future__ import annotations

import atexit
import os
import sys
import warnings

import torch.distributed as dist


def _record(path: str) -> None:
    with open(path, "w") as f:
        f.write("alive" if dist.is_initialized() else "destroyed")


def main(which: str, out: str) -> None:
    atexit.register(_record, f"{out}.{os.environ['RANK']}")
    warnings.filterwarnings("ignore")

    import lightning as L
    import torch
    from _auto_plan_models import ChainMLP, trainer_kwargs

    import lightning_distplan  # noqa: F401  (registers the strategy names)
    from lightning_distplan.callbacks import PlanningCallback

    torch.set_num_threads(1)
    callbacks = []
    strategy = {"dp_ga": "dp_ga", "auto_plan": "auto_plan", "gpipe": "gpipe"}.get(which, "ddp")
    if which == "callback":
        callbacks.append(PlanningCallback())
    model = ChainMLP(width=16, depth=4, n_samples=64, loader_batch=8, dropout=0.0)
    world = int(os.environ["WORLD_SIZE"])
    trainer = L.Trainer(**trainer_kwargs(out + ".root", strategy=strategy, devices=world, max_steps=2, callbacks=callbacks))
    trainer.fit(model)


if __name__ == "__main__":
    main(*sys.argv[1:])
