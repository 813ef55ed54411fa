"""One epoch of Lightning's demo Transformer on synthetic tokens under ``strategy="auto_plan"`` (CPU).

The run itself reports what planning cost: ``auto_plan`` logs the profiling progress and, at the
end of ``fit``, "planning overhead X s = Y% of this fit". This script also prints one JSON line
with those numbers (rank 0), so the overhead claim can be checked; with ``--out FILE`` it adds the
run, with its date, load and versions, to FILE's ``runs`` (created when missing), so a few
runs make one result file (README's overhead row reads ``benchmarks/results/auto_plan_overhead_cpu.json``)::

    python examples/auto_plan_overhead.py --devices 2 --samples 8192
    for i in 1 2 3; do python examples/auto_plan_overhead.py --out benchmarks/results/auto_plan_overhead_cpu.json; done

Lightning's own launcher starts the second process (``strategy="auto_plan"`` is a DDP strategy).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.demos.transformer import LightningTransformer, Transformer

import lightning_distplan  # noqa: F401  (registers "auto_plan")
from lightning_distplan.callbacks import StepTimeMonitor
from lightning_distplan._files import check_output_path, write_text_atomic
from lightning_distplan._provenance import code_provenance
from lightning_distplan.demos import RandomTokenData
from lightning_distplan.errors import OutputPathError


SCHEMA = "distplan-auto-plan-overhead/1"
NHEAD = 4
"""Attention heads of :class:`OfflineTransformer`: ``--width`` must be a multiple of it."""


class OfflineTransformer(LightningTransformer):
    """Lightning's demo LightningModule with a Transformer of the given width and depth (nhead 4, feed-forward
    2 × ninp) in place of its default one (ninp 200, nhead 2, nhid 200), and no WikiText2 download (no internet here)."""

    def __init__(self, vocab_size: int, ninp: int, nlayers: int) -> None:
        super().__init__(vocab_size=vocab_size)
        self.model = Transformer(vocab_size=vocab_size, ninp=ninp, nhead=NHEAD, nhid=2 * ninp, nlayers=nlayers)

    def prepare_data(self) -> None:
        pass


def positive(text: str) -> int:
    """An argparse ``type``: a bad count is one line from argparse before the fit, not a traceback from inside it."""
    if not (text.isascii() and text.isdigit()) or int(text) < 1:  # "²" is a digit to str.isdigit, not to int()
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def width(text: str) -> int:
    value = positive(text)
    if value % NHEAD:
        raise argparse.ArgumentTypeError(f"{text!r} is not a multiple of {NHEAD} (the model's attention heads)")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=positive, default=2)
    parser.add_argument("--samples", type=positive, default=8192, help="samples in the one epoch (8192 = 256 steps of 16 per rank on 2 ranks)")
    parser.add_argument("--batch-size", type=positive, default=16, help="loader batch size per rank")
    parser.add_argument("--vocab", type=positive, default=1000)
    parser.add_argument("--block", type=positive, default=32)
    parser.add_argument("--width", type=width, default=128, help=f"model width (a multiple of {NHEAD})")
    parser.add_argument("--layers", type=positive, default=2)
    parser.add_argument("--root", default="runs/auto_plan_overhead")
    parser.add_argument("--out", default=None, help="add this run to the result JSON file's 'runs' (created when missing)")
    args = parser.parse_args()
    if args.out and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:  # before the fit, not after it
            check_output_path(args.out, "--out", example="auto_plan_overhead_cpu.json")
        except OutputPathError as err:
            raise SystemExit(str(err)) from None
        _existing(Path(args.out))
    load_start = os.getloadavg()

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    torch.manual_seed(0)
    model = OfflineTransformer(args.vocab, args.width, args.layers)
    data = RandomTokenData(vocab_size=args.vocab, block_size=args.block, batch_size=args.batch_size, num_samples=args.samples)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy="auto_plan", max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=args.root,
    )
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=data)
    wall = time.perf_counter() - t0
    if trainer.is_global_zero:
        monitor = next(cb for cb in trainer.callbacks if isinstance(cb, StepTimeMonitor))
        run = run_record(trainer.strategy.plan.describe(), monitor, wall)
        print(json.dumps(run))
        if args.out:
            _record(Path(args.out), run, args, load_start)


def run_record(plan: str, monitor: StepTimeMonitor, wall: float) -> dict:
    """One run's numbers: ``steps`` is the fit's optimizer steps (the epoch the overhead is a share of; README's row
    says "one CPU epoch (N steps)"), the median observed step is taken over those after the monitor's warm-up (the
    monitor's ``summary``; its median is the whole fit's while the fit has no more steps than ``history_size``)."""
    summary = monitor.summary
    return {
        "plan": plan,
        "overhead_s": round(monitor.overhead_s, 3),
        "fit_s": round(monitor.run_s, 3),
        "overhead_pct": round(100 * monitor.overhead_s / monitor.run_s, 2),
        "fit_wall_s": round(wall, 3),
        "steps": summary.steps,
        "observed_steps": summary.observed_steps,
        "predicted_step_s": monitor.predicted_step_time_s,
        "median_observed_step_s": summary.median_observed_s,
    }


def _existing(path: Path) -> dict:
    """The result file's runs so far ({} for a new file); exits with one line when it is some other file."""
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        doc = None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise SystemExit(f"{path} is not an auto_plan overhead result file ({SCHEMA}). HINT: give --out a new file name.")
    return doc


def _record(path: Path, run: dict, args: argparse.Namespace, load_start: tuple[float, float, float]) -> None:
    """Add ``run`` with its provenance to the result file (atomically replaced, so a crash never truncates it)."""
    doc = _existing(path)
    if not doc:
        doc = {"schema": SCHEMA, "what": "auto_plan's in-fit profiling + planning time as a share of a one-epoch CPU fit "
               "(Lightning's demo Transformer, gloo ranks on this machine)", "target_pct": 5.0, "runs": []}
    doc["runs"].append({
        **run,
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        **code_provenance(),  # versions (transformers' when installed) and, from a git checkout, its commit
        "config": {k: getattr(args, k) for k in ("devices", "samples", "batch_size", "vocab", "block", "width", "layers")},
    })
    write_text_atomic(path, json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
