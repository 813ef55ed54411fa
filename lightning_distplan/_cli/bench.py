"""``distplan bench package.module:ClassName --world-size N --global-batch-size B``: predicted vs measured.

Profiles the model, ranks the plans, runs every chosen plan for real (a fresh Lightning Trainer
per plan, this package's strategies) and prints per-plan error, median / p90 |error|, whether the
planner's pick is the measured best (or within 5%) and the regret; ``--out`` writes the JSON,
``--plot`` a predicted-vs-measured PNG.

Multi-process runs go through torchrun: with ``--world-size N > 1`` outside a torchrun job this
command starts ``python -m torch.distributed.run --standalone --nproc-per-node N -m
lightning_distplan.cli bench ...`` (one node; ``--print-launch`` prints that command instead).
For several nodes start torchrun yourself on each node with ``--nnodes``; inside the job all
ranks run the candidates one after the other in the same processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from collections.abc import Iterator
from typing import Any

__all__ = ["add_parser", "run", "torchrun_command", "worker_env"]


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="run candidate plans for real and compare measured with predicted step time and memory",
        description=(
            "Profile a LightningModule, rank the plans for --world-size and --global-batch-size, train each chosen plan "
            "for --warmup + --steps optimizer steps with lightning_distplan's strategies, and report predicted vs measured."
        ),
    )
    parser.add_argument("model", metavar="package.module:ClassName", help="import path of the LightningModule class")
    parser.add_argument("--init-args", default="{}", metavar="JSON", help="keyword arguments for the model's constructor")
    parser.add_argument("--datamodule", default=None, metavar="package.module:ClassName", help="LightningDataModule class giving the batches")
    parser.add_argument("--datamodule-args", default="{}", metavar="JSON", help="keyword arguments for the datamodule's constructor")
    parser.add_argument("--world-size", type=int, required=True, help="processes in the job (torchrun is started for N > 1)")
    parser.add_argument("--global-batch-size", type=int, required=True, help="samples per optimizer step (the same for every plan)")
    parser.add_argument("--plans", default="all", help="'all' feasible plans (default), 'top:K', or planner ranks 'N,M,...'")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per plan and pass; the median is reported (default 5)")
    parser.add_argument("--min-time", type=float, default=0.0, metavar="SECONDS",
                        help="time each plan for at least about this long per pass: a plan predicted at t s a step runs "
                        "max(--steps, SECONDS / t) timed steps, at most 200 (default 0: exactly --steps; fast plans on a noisy host want ~1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps per plan first (default 2)")
    parser.add_argument("--passes", type=int, default=2,
                        help="run the list of plans this many times, in alternating order, and pool each plan's timed steps (default 2)")
    parser.add_argument("--confirm", type=int, default=0, metavar="K",
                        help="after the passes, run the contenders for the measured best (the pick, the first profile's pick, the fastest plan "
                        "and those within 10%% of it, four in all unless the picks make more) K more times and judge the pick's regret "
                        "on those runs alone (default 0: no confirmation)")
    parser.add_argument("--rank-timeout", type=float, default=None, metavar="SECONDS",
                        help="how long a rank that finished or failed a plan's run waits for the others before the benchmark stops "
                        "(default 180): a rank failing alone, e.g. one GPU out of memory first, leaves the others waiting in a collective")
    parser.add_argument("--profile-once", action="store_true",
                        help="predict from the one profile taken before the runs (default: profile again after each pass and "
                        "predict from the mean of all profiles, so a drifting host's speed weighs on both sides alike)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="device (default: cuda when present); on cuda each process takes a GPU of its own, so a "
                        "--world-size above this machine's GPU count is refused before launch")
    from lightning_distplan.profile import PRECISIONS

    parser.add_argument("--precision", default="32-true", choices=PRECISIONS,
                        help="Trainer(precision=...) of every run and of the profiling (default 32-true); pipelines train "
                        "in 32-true, bf16-mixed and bf16-true only, so another precision runs dp_ga plans only")
    parser.add_argument("--micro-batch-sizes", default=None, metavar="M1,M2,...", help="sizes to profile (default: powers of two from 1 up to the global batch, and at least three: 1,2,4 for a global batch under 4)")
    parser.add_argument("--profile-repeats", type=int, default=3, help="timed runs per profiled size (default 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads per process (default: torch's; with --world-size N > 1, 1 per "
                        "process unless OMP_NUM_THREADS is set, as torchrun sets it)")
    parser.add_argument("--out", default=None, help="write the result JSON here")
    parser.add_argument("--format", choices=("table", "json"), default="table",
                        help="what to print (default table); json: the result (less its profiles) alone on stdout, progress lines on stderr")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write a predicted-vs-measured scatter here (needs matplotlib: pip install \"lightning_distplan[dashboard]\")")
    parser.add_argument("--print-launch", action="store_true", help="with --world-size > 1: print the torchrun command instead of running it")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.set_defaults(run=run)


def _inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _forwarded(args: argparse.Namespace) -> list[str]:
    out = [args.model, "--world-size", str(args.world_size), "--global-batch-size", str(args.global_batch_size)]
    for flag in ("init_args", "datamodule", "datamodule_args", "plans", "steps", "min_time", "warmup", "passes", "confirm", "rank_timeout", "device", "precision", "micro_batch_sizes",
                 "profile_repeats", "threads", "out", "format", "plot"):
        value = getattr(args, flag)
        if value is not None:
            out += ["--" + flag.replace("_", "-"), str(value)]
    for flag in ("profile_once", "quiet"):
        if getattr(args, flag):
            out.append("--" + flag.replace("_", "-"))
    return out


def torchrun_command(args: argparse.Namespace, log_dir: str | None = None) -> list[str]:
    """The single-node torchrun command that runs this benchmark on ``--world-size`` processes (its logs under ``log_dir``)."""
    logs = [] if log_dir is None else ["--log-dir", log_dir]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.world_size), *logs,
        "-m", "lightning_distplan.cli", "bench", *_forwarded(args),
    ]


def worker_env() -> dict[str, str]:
    """What the torchrun workers' environment adds to this process's.

    The workers start as ``python -m lightning_distplan.cli``, which puts the current folder first on sys.path before
    anything is imported: a torch.py or json.py there would replace the real one. PYTHONSAFEPATH (Python >= 3.11)
    leaves it off, and the command adds it after its own imports, for the model, as the ``distplan`` script does.
    Where this process imported the package from the current folder (``python -m`` in a source checkout), that folder
    goes on PYTHONPATH instead, so that the workers run this same code and not another copy installed (or none).
    """
    import lightning_distplan

    env = {"PYTHONSAFEPATH": "1"}
    root = Path(lightning_distplan.__file__).resolve().parents[1]
    if root == Path.cwd().resolve():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return env


def _launch_line(cmd: list[str]) -> str:
    """The torchrun command as a shell line, with what the workers' environment adds."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in worker_env().items()), shlex.join(cmd)])


PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")
_ERROR_START = re.compile(r"(?=distplan bench: (?:error:|interrupted|no plan produced a measurement))")
_NO_MEASUREMENT = "distplan bench: no plan produced a measurement"  # rank 0's exit status 1, not a user error


def _run_torchrun(cmd: list[str]) -> int:
    """Run the torchrun job, passing its output on; a user error is one line, a Ctrl-C stops the workers.

    Every worker reports the same user error (bad ``--plans`` found after profiling, say): it is
    shown once, with exit status 2, and what torchrun prints about the failed worker after it (its
    own traceback) is dropped; so it is after rank 0's line that no plan produced a measurement
    (exit status 1, as in one process). ``subprocess.run`` would SIGKILL torchrun on an interrupt and leave
    its workers running (and writing ``--out`` later); torchrun passes a SIGINT on to its workers.
    """
    import signal

    env = {**os.environ, **worker_env()}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1, env=env)
    assert proc.stderr is not None
    errors: list[str] = []

    def terminated(signum: int, frame: Any) -> None:  # `kill <pid>`: stop the job as a Ctrl-C does, not leave it running
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        for chunk in proc.stderr:
            # two ranks failing at once may write their error lines into one line of the pipe
            for line in _ERROR_START.split(chunk):
                if not line:
                    continue
                if _ERROR_START.match(line):
                    line = line if line.endswith("\n") else line + "\n"
                    if line not in errors:
                        errors.append(line)
                        sys.stderr.write(line)
                elif not errors:  # after a worker's own error line, the rest is torchrun's report of that failure
                    sys.stderr.write(line)
        code = proc.wait()
    except (KeyboardInterrupt, _Terminated) as stop:
        # torchrun passes either signal on to its workers and waits for them
        proc.send_signal(signal.SIGINT if isinstance(stop, KeyboardInterrupt) else signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if isinstance(stop, KeyboardInterrupt):
            raise
        print("distplan bench: terminated; no result file was written", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 2 if code != 0 and any(not line.startswith(_NO_MEASUREMENT) for line in errors) else code


class _Terminated(Exception):
    """SIGTERM reached ``distplan bench`` while its torchrun job ran."""


def _progress_stream(args: argparse.Namespace) -> Any:
    """Where progress lines go: stdout beside the table; stderr with ``--format json``, whose stdout is the JSON alone."""
    return sys.stderr if args.format == "json" else sys.stdout


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """One Trainer per plan: Lightning's per-fit banners ("GPU available ...") would drown the report. Only while the
    command runs: ``main(["bench", ...])`` may run in the caller's process (a notebook, a test), whose logger levels and
    warning filters it gives back."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning_distplan.strategies")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        for lg in loggers:
            lg.setLevel(logging.WARNING)
        warnings.filterwarnings("ignore", message=".*(does not have many workers|number of training batches|max_epochs=-1|smaller than the logging interval|isinstance\\(treespec, LeafSpec\\)|PipelineStrategy runs the pipeline itself).*")
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


def _check_before_launch(args: argparse.Namespace, init_args: dict[str, Any], dm_args: dict[str, Any]) -> None:
    """What each rank would refuse at once, refused here in one sentence before torchrun starts them: the device, the
    classes and the arguments their constructors take (the ranks build them; building here could take minutes)."""
    import inspect

    from lightning_distplan._cli.profile import _load_class, build_error

    _check_gpu_count(args.device, args.world_size)
    checks = [(args.model, "model", "", init_args, "--init-args")]
    if args.datamodule:
        checks.append((args.datamodule, "datamodule", "--datamodule ", dm_args, "--datamodule-args"))
    for path, what, option, kwargs, kwargs_option in checks:
        cls = _load_class(path, what=what, option=option)
        _check_kind(cls, path, what)
        try:
            inspect.signature(cls).bind(**kwargs)
        except TypeError as err:
            raise build_error(what, path, kwargs, err, kwargs_option) from None
        except ValueError:  # a signature inspect cannot read: the ranks will say
            pass


def _check_gpu_count(device: str, processes: int) -> None:
    """Refuse ``--device cuda`` without a GPU, and ``--device auto|cuda`` with fewer GPUs than the ``processes`` this node
    starts: each process takes the GPU of its local rank, and one without a GPU failed alone ("invalid device ordinal")
    while the others waited at the rendezvous."""
    import torch

    # is_available and device_count make no CUDA context in this process, which runs no plan before torchrun starts
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return
    from lightning_distplan.errors import DeviceUnavailableError
    from lightning_distplan.profiling._device import resolve_device

    resolve_device("cuda")  # --device cuda and no GPU at all: its own sentence
    gpus = torch.cuda.device_count()
    if gpus < processes:
        raise DeviceUnavailableError(
            f"--device {device} runs each of the {processes} processes on this machine on a GPU of its own, but torch sees "
            f"{gpus} CUDA GPU(s) here.",
            hint=f"Use --device cpu, or --world-size {gpus} or less (or start torchrun on several nodes yourself, "
            f"with at most {gpus} processes per node).",
        )


def _check_kind(cls: type, path: str, what: str) -> None:
    """Refuse a model class that is no LightningModule, or a datamodule class that is no LightningDataModule."""
    from lightning.pytorch import LightningDataModule, LightningModule

    from lightning_distplan.bench._bench import BenchError

    base = LightningModule if what == "model" else LightningDataModule
    if not issubclass(cls, base):
        raise BenchError(f"{path} is not a {base.__name__}.", hint=f"Name a lightning.pytorch.{base.__name__} subclass.")


def run(args: argparse.Namespace) -> int:
    from lightning_distplan._cli.profile import _json_kwargs, _load_class, _sizes
    from lightning_distplan._files import check_output_path, check_replaceable, check_replaceable_figure
    from lightning_distplan.bench._bench import RANK_TIMEOUT_S, BenchError, check_counts, parse_plans_spec

    if args.world_size < 1 or args.global_batch_size < 1:
        raise BenchError(
            f"--world-size ({args.world_size}) and --global-batch-size ({args.global_batch_size}) must be positive.",
            hint="Use e.g. --world-size 2 --global-batch-size 32.",
        )
    parse_plans_spec(args.plans)
    if args.rank_timeout is None:
        args.rank_timeout = RANK_TIMEOUT_S
    check_counts(steps=args.steps, warmup=args.warmup, passes=args.passes, confirm=args.confirm, min_time_s=args.min_time,
                 rank_timeout_s=args.rank_timeout)
    if args.threads is not None and args.threads < 1:
        raise BenchError(f"--threads must be >= 1, got {args.threads}.", hint="Use e.g. --threads 1.")
    init_args = _json_kwargs(args.init_args, "--init-args")
    dm_args = _json_kwargs(args.datamodule_args, "--datamodule-args")
    sizes = _sizes(args.micro_batch_sizes)
    if args.profile_repeats < 1:  # before torchrun starts the ranks (each would refuse it, in the profiler's words)
        raise BenchError(f"--profile-repeats must be >= 1, got {args.profile_repeats}.", hint="Use e.g. --profile-repeats 3.")
    for option, value, example in (("--out", args.out, "bench.json"), ("--plot", args.plot, "bench.png")):
        if value is not None:
            check_output_path(value, option, example=example)  # before the runs, which take minutes
    if args.out is not None:
        check_replaceable(args.out, "--out", what="distplan bench result",
                          is_ours=lambda d: isinstance(d, dict) and str(d.get("schema", "")).startswith("distplan-bench"))
    if args.plot is not None:
        from pathlib import Path

        if args.out is not None and Path(args.plot).resolve() == Path(args.out).resolve():
            raise BenchError(f"--out and --plot name the same file {args.plot!r}.", hint="Give the plot its own name, e.g. --plot bench.png.")
        if Path(args.plot).suffix.lower() not in PLOT_SUFFIXES:
            raise BenchError(
                f"--plot {args.plot!r} has no image suffix matplotlib writes ({', '.join(PLOT_SUFFIXES)}).", hint="Use e.g. --plot bench.png."
            )
        check_replaceable_figure(args.plot, "--plot")
        from lightning_distplan.tuner._dashboard import require

        require("matplotlib")  # an optional package (the dashboard extra): refused now, not after the runs
    if args.print_launch and args.world_size == 1:
        raise BenchError(
            "--print-launch prints the torchrun command of a multi-process bench, but --world-size 1 runs in this process without one.",
            hint="Drop --print-launch to run it, or pass --world-size 2 or more.",
        )
    if args.world_size > 1 and not _inside_torchrun():
        _check_before_launch(args, init_args, dm_args)
        if args.print_launch:
            print(_launch_line(torchrun_command(args)))
            return 0
        # torchrun keeps a log folder per run (torchelastic_* in the temporary folder) unless told where: one of
        # ours, removed when the job ends
        with tempfile.TemporaryDirectory(prefix="distplan-bench-torchrun-") as logs:
            cmd = torchrun_command(args, logs)
            if not args.quiet:
                print(f"distplan bench: launching {args.world_size} processes with torchrun: {_launch_line(cmd)}", flush=True,
                      file=_progress_stream(args))
            return _run_torchrun(cmd)

    cls = _load_class(args.model, what="model", option="")
    _check_kind(cls, args.model, "model")
    dm_cls = None
    if args.datamodule:
        dm_cls = _load_class(args.datamodule, what="datamodule", option="--datamodule ")
        _check_kind(dm_cls, args.datamodule, "datamodule")

    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
        # Lightning's DDP sets torch's threads to cpu_count // processes unless OMP_NUM_THREADS is set.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with _quiet_lightning():
        return _bench_here(args, cls, dm_cls, init_args, dm_args, sizes)


def _bench_here(args: argparse.Namespace, cls: type, dm_cls: type | None, init_args: dict[str, Any], dm_args: dict[str, Any],
                sizes: list[int] | None) -> int:
    """The bench itself, in this process: one rank of a torchrun job, or the whole of a --world-size 1 run."""
    import torch
    import torch.distributed as dist
    from lightning.pytorch import LightningModule

    from lightning_distplan._cli.profile import _build, train_loader
    from lightning_distplan._files import write_text_atomic
    from lightning_distplan.bench._bench import BenchError

    created_group = False
    if _inside_torchrun() and not dist.is_initialized():
        from lightning_distplan.bench._bench import ranks_per_machine

        local = ranks_per_machine(args.world_size)  # a bad LOCAL_WORLD_SIZE, refused by every rank before the group starts
        use_cuda = args.device != "cpu" and torch.cuda.is_available()
        if use_cuda:
            # every rank refuses a node with fewer GPUs than its processes, not one rank alone at set_device
            _check_gpu_count(args.device, local)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if use_cuda else "gloo")
        created_group = True
    rank = dist.get_rank() if dist.is_initialized() else 0
    if dist.is_initialized() and dist.get_world_size() != args.world_size:
        raise BenchError(
            f"--world-size {args.world_size} differs from the torchrun job's {dist.get_world_size()} processes.",
            hint="Pass the job's world size (nnodes x nproc-per-node).",
        )
    try:
        datamodule = _build(dm_cls, dm_args, "datamodule", args.datamodule, "--datamodule-args") if dm_cls else None
        probe = None if datamodule is not None else _build(cls, init_args, "model", args.model, "--init-args")
        loader = train_loader(probe, datamodule, model_path=args.model, datamodule_path=args.datamodule)
        del probe

        def make_module() -> LightningModule:
            module = _build(cls, init_args, "model", args.model, "--init-args")
            return module

        from lightning_distplan.bench import format_table, plot_result, run_bench

        stream = _progress_stream(args)
        say = (lambda line: None) if (args.quiet or rank != 0) else (lambda line: print(line, flush=True, file=stream))
        result = run_bench(
            make_module, loader, world_size=args.world_size, global_batch_size=args.global_batch_size, plans=args.plans,
            steps=args.steps, warmup=args.warmup, passes=args.passes, confirm=args.confirm, min_time_s=args.min_time, rank_timeout_s=args.rank_timeout, reprofile=not args.profile_once, device=None if args.device == "auto" else args.device,
            micro_batch_sizes=sizes, profile_repeats=args.profile_repeats, precision=args.precision, progress=say,
            meta={"command": "distplan bench " + shlex.join(_forwarded(args)), "model_init_args": init_args,
                  "datamodule": args.datamodule, "datamodule_args": dm_args},
        )
        if rank != 0 and result["stopped"] and args.out:
            # A rank failed alone and the runs stopped. The rank left waiting in a collective is freed only when this
            # process ends, so this rank keeps the plans measured so far (rank 0, once freed, writes the same records
            # over them and reports) and then ends with status 0: a non-zero one would have torchrun end rank 0 first.
            write_text_atomic(args.out, json.dumps(result, indent=1))
            print(f"distplan bench: rank {rank} wrote the plans run before the stop to {args.out}", flush=True, file=_progress_stream(args))
        if rank == 0:
            # The report first: a file that fails to write must not take the measurements with it.
            if args.format == "json":
                print(json.dumps({k: v for k, v in result.items() if k not in ("profile", "profiles", "profiles_left_out")}, indent=1), flush=True)
            else:
                print(format_table(result), flush=True)
            if args.out:
                write_text_atomic(args.out, json.dumps(result, indent=1))
            try:
                if args.plot:
                    plot_result(result, args.plot)
                if args.format == "table" and (args.out or args.plot):
                    written = [f"result written to {args.out}"] if args.out else []
                    print(", ".join(written + ([f"plot to {args.plot}"] if args.plot else [])))
            except KeyboardInterrupt:
                if args.out:  # main says what was kept
                    raise KeyboardInterrupt(f"the result was written to {args.out}") from None
                raise
    finally:
        if created_group and dist.is_initialized():
            dist.destroy_process_group()
    if result["stopped"]:
        print(f"distplan bench: error: {result['stopped']}", file=sys.stderr)
        return 2 if rank == 0 else 0
    if not result["summary"]["n_measured"]:  # every plan failed: the report says why, the exit status says it failed
        if rank == 0:
            print("distplan bench: no plan produced a measurement (each plan's error is in the report).", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from lightning_distplan.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
