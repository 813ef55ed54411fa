"""``distplan dashboard URL``: serve a tuning study in optuna-dashboard on loopback.

Equivalent to ``optuna-dashboard URL --host 127.0.0.1 --port 8080 --artifact-dir DIR``, with the
storage checked first (a missing SQLite file is an error, not a new empty database) and the
artifact directory that :func:`lightning_distplan.tuner.plots.attach_to_study` writes picked up
without a flag.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "dashboard",
        help="serve a tuning study in optuna-dashboard (loopback by default)",
        description="Serve the Optuna storage written by `distplan tune` in optuna-dashboard: Pareto front, "
        "per-trial breakdowns (user attributes), the summary note and plot artifacts.",
    )
    parser.add_argument("storage", metavar="URL", help="Optuna storage URL, e.g. sqlite:///distplan.db")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; the dashboard has no authentication)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080; 0 picks a free one)")
    parser.add_argument(
        "--artifact-dir",
        default=None,
        help="directory of study artifacts (plot PNGs); default: <db stem>-artifacts next to a SQLite file when it exists",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from lightning_distplan.tuner._dashboard import LOOPBACK_HOSTS, DashboardBindError, DashboardServer
    from lightning_distplan.tuner._storage import shown_url

    if not 0 <= args.port <= 65535:
        raise DashboardBindError(f"--port must be in 0..65535, got {args.port}.", hint="Use e.g. --port 8080, or 0 for a free port.")
    server = DashboardServer(args.storage, host=args.host, port=args.port, artifact_dir=args.artifact_dir)
    if args.host not in LOOPBACK_HOSTS:
        print(f"distplan dashboard: warning: listening on {args.host}, reachable from other machines; optuna-dashboard has no authentication.", file=sys.stderr)
    artifacts = f", artifacts from {server.artifact_dir}" if server.artifact_dir else ""
    print(f"optuna-dashboard serving {shown_url(args.storage)}{artifacts} at {server.url}  (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("distplan dashboard: stopped", file=sys.stderr)
    return 0
