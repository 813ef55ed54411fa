"""When does a gloo point-to-point message cross a rate-limited link: at the send, or once the receiver posts its recv?

Two ranks, one in each network namespace of ``scripts/netns_cluster.sh`` (a veth pair shaped with
``tc tbf``, 100 Mbit/s by default), exchange one message per size. Rank 0 calls ``isend`` and waits
on it; rank 1 posts its ``recv`` either at once or ``--delay`` seconds later. If the bytes crossed
the link while rank 1 was still busy (an eager send, buffered by the kernels), the late recv would
return at once; if they cross only once the recv is posted (a rendezvous), it takes the whole
transfer time after posting, as the prompt one does.

Second part (``batched``): both ranks post one ``batch_isend_irecv`` of a send to the other and a
recv from it, as ``Schedule1F1B`` does in its steady state, rank 1 ``--exchange-delay`` seconds
after rank 0; each batch lists the send first (torch's order) or the recv first. Each rank's wait
after its own posting is timed (median of three). If the two messages crossed side by side, the
late rank would wait one message time either way.

What it showed on the 2-vCPU sweep host (2026-11-23, 100 Mbit/s): the late recv took as long as
the prompt one at every size from 64 KiB to 4 MiB (256 KiB: ~21 ms, the link's time for it), and
the sender's wait ended only after the receiver had posted. So a pipeline hand-over over gloo
starts when the receiving stage asks for it, never earlier: a stage busy with other micro-batches
does not receive in the background. In the batched part the late rank waited two message times
with the send first and one with the recv first: it finds rank 0's recv waiting and its data goes
out at once, and the "ready" notice of its own recv follows that data on the pair's one TCP
stream, so rank 0's message crosses only after it. The cost model's stage programs
(``costmodel/_schedule.py``) price both; before them the model let 1F1B's activations and
gradients cross side by side, and in the sweeps of that day the demo Transformer's 1F1B at
100 Mbit/s was predicted 9-23% under, GPipe's at m = 8 and 16 within 4%.

Needs root (network namespaces). The cluster is torn down at the end.

Run:
    sudo .venv/bin/python benchmarks/gloo_rendezvous.py [--rate 100mbit] [--delay 0.3] [--exchange-delay 0.05]
Writes benchmarks/results/gloo_rendezvous_cpu.json (the committed result the README cites; it says so before
replacing it; ``--out FILE`` writes elsewhere) and prints one line per size and delay.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "netns_cluster.sh"
RESULT = ROOT / "benchmarks" / "results" / "gloo_rendezvous_cpu.json"
PREFIX = os.environ.get("DISTPLAN_NETNS_PREFIX", "distplan_n")
SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
BATCHED_SIZES = (256 << 10, 1 << 20)
BATCHED_REPEATS = 3


def _rank(rank: int, delay: float, exchange_delay: float, port: int) -> None:
    """One rank's side of every exchange; prints one JSON line per exchange."""
    import statistics

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://10.77.0.1:{port}", rank=rank, world_size=2)
    for nbytes in SIZES:
        message = torch.zeros(nbytes // 4)
        for late in (0.0, delay):
            dist.barrier()
            if rank == 0:
                t0 = time.perf_counter()
                dist.isend(message, 1).wait()
                print(json.dumps({"bytes": nbytes, "recv_posted_after_s": late, "sender_wait_s": time.perf_counter() - t0}), flush=True)
            else:
                time.sleep(late)
                t0 = time.perf_counter()
                dist.recv(message, 0)
                print(json.dumps({"bytes": nbytes, "recv_posted_after_s": late, "recv_after_posting_s": time.perf_counter() - t0}), flush=True)
            dist.barrier()
    for nbytes in BATCHED_SIZES:
        out, into = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)
        for first in ("send", "recv"):
            waits = []
            for _ in range(BATCHED_REPEATS):
                dist.barrier()
                if rank == 1:
                    time.sleep(exchange_delay)
                ops = [dist.P2POp(dist.isend, out, 1 - rank), dist.P2POp(dist.irecv, into, 1 - rank)]
                t0 = time.perf_counter()
                for work in dist.batch_isend_irecv(ops if first == "send" else ops[::-1]):
                    work.wait()
                waits.append(time.perf_counter() - t0)
                dist.barrier()
            print(json.dumps({"batched": True, "bytes": nbytes, "first": first, "rank": rank, "posted_after_s": exchange_delay * rank,
                              "wait_s": statistics.median(waits)}), flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="link rate for scripts/netns_cluster.sh (default 100mbit)")
    parser.add_argument("--delay", type=float, default=0.3, help="seconds the receiver waits before posting the late recv (default 0.3)")
    parser.add_argument("--exchange-delay", type=float, default=0.05,
                        help="seconds after rank 0 that rank 1 posts its batched send and recv (default 0.05)")
    parser.add_argument("--port", type=int, default=29588)
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/gloo_rendezvous_cpu.json, the committed result)")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # internal: run one rank
    args = parser.parse_args(argv)
    if args.rank is not None:
        _rank(args.rank, args.delay, args.exchange_delay, args.port)
        return 0
    for name, value, example in (("--delay", args.delay, 0.3), ("--exchange-delay", args.exchange_delay, 0.05)):
        if not value > 0:
            raise SystemExit(f"gloo_rendezvous: {name} ({value}) must be > 0 seconds. HINT: use e.g. {name} {example}.")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _results import result_path, write_result  # here, not at the top: the ranks need neither it nor lightning

    out = result_path(args.out, RESULT, script="gloo_rendezvous")
    up = subprocess.run(["bash", str(SCRIPT), "up", "--rate", args.rate], capture_output=True, text=True)
    if up.returncode == 77:  # namespaces not permitted here: the cluster script's own one-line reason
        print(f"gloo_rendezvous: {up.stderr.strip()}", file=sys.stderr)
        return 77
    if up.returncode != 0:
        raise SystemExit(f"gloo_rendezvous: could not set up the namespace cluster: {up.stderr.strip()}")
    procs: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` (a test's timeout): clean up as a Ctrl-C does
    try:
        procs = [
            subprocess.Popen(
                ["ip", "netns", "exec", f"{PREFIX}{r}", "env", f"GLOO_SOCKET_IFNAME={PREFIX}{r}v", "OMP_NUM_THREADS=1",
                 sys.executable, __file__, "--rank", str(r), "--delay", str(args.delay), "--exchange-delay", str(args.exchange_delay),
                 "--port", str(args.port)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            for r in (0, 1)
        ]
        outs = [p.communicate(timeout=300) for p in procs]
    except KeyboardInterrupt:
        print("gloo_rendezvous: interrupted; the ranks were stopped and the namespaces removed.", file=sys.stderr)
        return 130
    finally:
        for p in procs:  # a rank still running (interrupted, timed out) would keep its namespace in use
            if p.poll() is None:
                p.kill()
                p.wait()
        subprocess.run(["bash", str(SCRIPT), "down"], capture_output=True, text=True)
    if any(p.returncode for p in procs):
        raise SystemExit(f"gloo_rendezvous: a rank failed: {outs[0][1][-500:]} {outs[1][1][-500:]}")
    lines = [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out, _ in outs]
    sender, receiver = ([row for row in rank_lines if not row.get("batched")] for rank_lines in lines)
    rows = [{**s, **r} for s, r in zip(sender, receiver)]
    for row in rows:
        print(f"{row['bytes'] >> 10:6d} KiB, recv posted after {row['recv_posted_after_s'] * 1e3:4.0f} ms: "
              f"recv took {row['recv_after_posting_s'] * 1e3:7.2f} ms after posting, the sender's wait {row['sender_wait_s'] * 1e3:7.2f} ms")
    batched = [{k: v for k, v in row.items() if k != "batched"} for rank_lines in lines for row in rank_lines if row.get("batched")]
    for row in sorted(batched, key=lambda r: (r["bytes"], r["first"], r["rank"])):
        print(f"{row['bytes'] >> 10:6d} KiB batched, {row['first']} first, rank {row['rank']} posting at {row['posted_after_s'] * 1e3:3.0f} ms: "
              f"waited {row['wait_s'] * 1e3:7.2f} ms")
    import torch

    doc = {
        "rate": args.rate,
        "delay_s": args.delay,
        "exchange_delay_s": args.exchange_delay,
        "exchanges": rows,
        "batched": batched,
        "provenance": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["python", "benchmarks/gloo_rendezvous.py", *(argv if argv is not None else sys.argv[1:])]),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": {"cores": os.cpu_count(), "kernel": platform.release()},
            "cluster": "2 network namespaces (scripts/netns_cluster.sh), veth, tc tbf on both ends; gloo over the veth",
        },
    }
    write_result(out, doc)
    print(f"wrote {out}")
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
