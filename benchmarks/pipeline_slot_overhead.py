"""What one micro-batch costs the pipelining runtime itself, next to what the cost model charges for it.

Two gloo ranks on this machine run a two-stage ``torch.distributed.pipelining`` schedule (1F1B and
GPipe) whose stages are one ``nn.Linear(8, 8)`` each, so the compute is next to nothing and the
step time is the runtime's own per-micro-batch work (forward/backward bookkeeping, the
``batch_isend_irecv`` hand-overs and their waits). The per-micro-batch cost is the slope of the
median step time between n = 2 and n = 16 micro-batches. ``modelled_per_microbatch_ms`` is what
the cost model of the day (before 0a60779) charged per micro-batch for the hand-overs of this
schedule: the link latency once forward and once backward (2·L, L from ``profiling.measure_links``
on the same ranks). Today's model runs the schedule's own posts and waits
(``costmodel._schedule.schedule_time``), where over gloo the activation and the gradient the two
stages exchange cross one after the other: two L per micro-batch
(``profiling._links.trivial_pipeline_links``), and the rest of the measured 1F1B cost, 0.90 − 0.21
ms, as the runtime's own work per slot (``costmodel.PIPELINE_SLOT_S``, 0.7 ms).

The steps are timed by ``profiling._links.time_trivial_pipeline``, the same code the profiler's
``measure_pipeline_slot`` uses (alternating counts, one warm-up each). The committed result
(2026-11-22) predates that: it timed one count after the other (3 warm-up and 30 timed steps each).
Three runs of this script on the same host on 2026-11-23 gave 1.18, 1.17 and 0.90 ms per 1F1B
micro-batch and 1.60 to 1.78 ms per GPipe micro-batch: the host's noise is of the size of the gap.

Run:
    python benchmarks/pipeline_slot_overhead.py [--steps 30]
Writes benchmarks/results/pipeline_slot_overhead_cpu.json (the committed result the README quotes; it says so
before replacing it; ``--out FILE`` writes elsewhere) and prints a summary.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import socket
import statistics
import sys
from pathlib import Path

RESULT = Path(__file__).resolve().parent / "results" / "pipeline_slot_overhead_cpu.json"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import result_path, write_result  # noqa: E402
MICRO_BATCHES = (2, 8, 16)


def _worker(rank: int, port: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from lightning_distplan.profiling import measure_links
    from lightning_distplan.profiling._links import time_trivial_pipeline

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        _, p2p = measure_links()
        step_ms: dict[str, dict[int, float]] = {}
        for name, schedule in (("1f1b", Schedule1F1B), ("gpipe", ScheduleGPipe)):
            times = time_trivial_pipeline(schedule, rank, MICRO_BATCHES, steps)
            step_ms[name] = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        if rank == 0:
            Path(out).write_text(json.dumps({"step_ms": step_ms, "p2p_latency_ms": p2p.latency_s * 1e3}))
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per schedule and micro-batch count")
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default benchmarks/results/pipeline_slot_overhead_cpu.json, the committed result)")
    args = parser.parse_args()
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1. HINT: use the default, 30.")
    out = result_path(args.out, RESULT, script="pipeline_slot_overhead")

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raw = out.with_suffix(".raw.json")
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    load = os.getloadavg()
    mp.spawn(_worker, args=(port, args.steps, str(raw)), nprocs=2, join=True)
    measured = json.loads(raw.read_text())
    raw.unlink()

    lo, hi = MICRO_BATCHES[0], MICRO_BATCHES[-1]
    modelled = 2 * measured["p2p_latency_ms"]
    per_mb = {k: (v[str(hi)] - v[str(lo)]) / (hi - lo) for k, v in measured["step_ms"].items()}
    result = {
        "what": "per-micro-batch cost of a trivial two-stage torch.distributed.pipelining schedule vs the model's 2·L",
        "step_ms": measured["step_ms"],
        "per_microbatch_ms": per_mb,
        "modelled_per_microbatch_ms": modelled,
        "p2p_latency_ms": measured["p2p_latency_ms"],
        "provenance": {
            "command": shlex.join([sys.executable, *sys.argv]),
            "date": started,
            "device": f"cpu ({platform.machine()}, {os.cpu_count()} logical cores, 2 gloo ranks on loopback, 1 thread each)",
            "load_average_before": list(load),
            "versions": {"python": platform.python_version(), "torch": torch.__version__},
            "steps": args.steps,
        },
    }
    write_result(out, result, indent=2)
    for name, v in per_mb.items():
        steps = ", ".join(f"n={n}: {measured['step_ms'][name][str(n)]:.2f} ms" for n in MICRO_BATCHES)
        print(f"{name}: {steps}; {v:.2f} ms per micro-batch")
    print(f"the model charges 2·L = {modelled:.2f} ms per micro-batch (p2p L {measured['p2p_latency_ms'] * 1e3:.0f} us)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
