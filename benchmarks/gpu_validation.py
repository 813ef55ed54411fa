"""Single-GPU validation (issue 6): GPT-2 124M, BERT-Large and ResNet-101, predicted vs measured.

For each model it

1. profiles once with ``distplan``'s profiler at the default sizes around the loader's batch
   (b/2, b, 2b, 4b) and records the wall time that took (the profiling cost), also in steps of
   the loader's batch;
2. for micro-batch sizes that were NOT profiled (between and just past the profiled ones) × each
   accumulation setting, trains the ``dp_ga`` plan on one device with a real Lightning ``Trainer``
   (``distplan bench``'s :func:`~lightning_distplan.bench._runner.measure_plan`) and sets the
   median optimizer-step time and ``torch.cuda.max_memory_allocated`` (less what was allocated
   when the run began, recorded as ``allocated_before_run_bytes``) beside the cost model's
   prediction for the same ``Plan``. Each plan runs in a process of its own (forked before CUDA
   is touched: ``--isolate fork``, the default), as a user's fit does. Run one after another in
   one process, even each with a process group of its own, some fits peaked one gradient size
   higher than the same plan alone (``cuda_memory/README.md``); ``--isolate none`` runs them so;
3. (CUDA only) finds the real out-of-memory boundary of ``s = 1`` training with real fits
   (search around the prediction, then bisection), and sets it beside the largest micro-batch the
   model predicts to fit in the whole device and in the planner's usable share of it
   (``Hardware.memory_margin``, 90%), and runs that planner-feasible size to show it fits.

Acceptance (issue 6, GPU): median |step-time error| ≤ 10%, peak-memory error ≤ 5%, and no plan
predicted feasible runs out of memory.

Data are pools of pre-built random samples cycled by index (images: 4 loader workers, pinned), so a
step times the model, not a random-number generator. Matmuls run at ``--matmul-precision``
(default ``high``: TF32, what Lightning suggests on tensor-core GPUs), the same for profiling and
training.

Run:  python benchmarks/gpu_validation.py [--models gpt2,bert_large,resnet101] [--out FILE]
      python benchmarks/gpu_validation.py --no-oom-search        # the points only (~5 min on an H100)
      python benchmarks/gpu_validation.py --oom-only --out benchmarks/results/gpu_validation_<device>_oom.json
      python benchmarks/gpu_validation.py --tiny --device cpu     # a smoke run, no GPU
Result: benchmarks/results/gpu_validation_<device name>.json (``_oom.json`` for ``--oom-only``; provenance
included), the committed result the README's GPU rows are made from (the script says so before it
replaces one); a run on a CPU or with ``--tiny`` goes to runs/ instead, never among them. The JSON is
rewritten after every measurement, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import os

# Asked before torch is imported: "is there a GPU?" answered by NVML, not by initialising CUDA, so
# the processes forked for each plan (--isolate fork) can start CUDA of their own.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import argparse
import copy
import datetime
import gc
import multiprocessing
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_distplan
from lightning_distplan._cli.bench import _quiet_lightning
from lightning_distplan.bench import percentile
from lightning_distplan.bench._runner import measure_plan
from lightning_distplan.bench.models import BertMaskedLM, TinyGPT2LM
from lightning_distplan.costmodel import Hardware, predict
from lightning_distplan.demos import RandomImageData, RandomTokenData, TorchvisionClassifier
from lightning_distplan.plan import Plan
from lightning_distplan.profile import Profile
from lightning_distplan.profiling import profile_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import positive_ints, result_path, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Spec:
    """One benchmark model: how to build it, its data, and the loader batch the profiler starts from."""

    make_module: Callable[[], L.LightningModule]
    make_base: Callable[[int], Dataset]
    loader_batch: int
    workers: int
    what: str


def _gpt2(tiny: bool) -> Spec:
    cfg = dict(vocab_size=512, n_embd=64, n_layer=2, n_head=2, n_positions=32) if tiny else \
        dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024)
    return Spec(lambda: TinyGPT2LM(**cfg), lambda n: _dataset(RandomTokenData(vocab_size=cfg["vocab_size"], block_size=cfg["n_positions"], num_samples=n)),
                loader_batch=8, workers=0, what=f"GPT-2 {cfg} (Hugging Face GPT2LMHeadModel, AdamW), sequence {cfg['n_positions']}")


def _bert(tiny: bool) -> Spec:
    cfg = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128) if tiny else \
        dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
    seq = 32 if tiny else 128
    return Spec(lambda: BertMaskedLM(**cfg), lambda n: _dataset(RandomTokenData(vocab_size=cfg["vocab_size"], block_size=seq, num_samples=n)),
                loader_batch=16, workers=0, what=f"BERT masked LM {cfg} (Hugging Face BertForMaskedLM, AdamW), sequence {seq}")


def _resnet(tiny: bool) -> Spec:
    arch, size, classes = ("resnet18", 32, 10) if tiny else ("resnet101", 224, 1000)
    return Spec(lambda: TorchvisionClassifier(arch, num_classes=classes),
                lambda n: _dataset(RandomImageData(num_classes=classes, image_size=size, num_samples=n)),
                loader_batch=32, workers=0 if tiny else 4, what=f"torchvision {arch}, {size}x{size} images, {classes} classes (SGD momentum)")


MODELS = {"gpt2": _gpt2, "bert_large": _bert, "resnet101": _resnet}


def _dataset(dm: Any) -> Dataset:
    dm.setup("fit")
    return dm.dataset


class PoolDataset(Dataset):
    """``length`` samples cycling over pre-built ones: fetching a sample costs an index, nothing more."""

    def __init__(self, base: Dataset, length: int) -> None:
        self.samples = [base[i] for i in range(len(base))]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        return self.samples[i % len(self.samples)]

    def sized(self, length: int) -> PoolDataset:
        """A pool of its own ``length`` over the same pre-built samples (shared, not copied)."""
        view = copy.copy(self)
        view.length = length
        return view


def unprofiled_sizes(profiled: list[int]) -> list[int]:
    """The midpoints between neighbouring profiled sizes, and 1.5x the largest: sizes the fit never saw."""
    mids = [(a + b) // 2 for a, b in zip(profiled, profiled[1:]) if (a + b) // 2 not in profiled]
    return sorted(set(mids + [profiled[-1] + profiled[-1] // 2]))


def predicted_largest_micro_batch(profile: Any, hardware: Hardware, limit_bytes: float, ceiling: int = 1 << 16) -> int:
    """Largest m whose predicted s=1 peak memory is at most ``limit_bytes`` (0: not even one sample).

    Bisection on ``predict(...).peak_memory_bytes``, which never decreases with m."""

    def fits(m: int) -> bool:
        plan = Plan(strategy="dp_ga", dp=1, micro_batch_size=m, accumulate_grad_batches=1, global_batch_size=m)
        return predict(profile, plan, hardware).peak_memory_bytes <= limit_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= ceiling and fits(hi):
        lo, hi = hi, hi * 2
    if hi > ceiling:
        return lo
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def find_boundary(runs: Callable[[int], bool], start: int, *, resolution: float = 0.02, step: float = 1.25, limit: int = 1 << 16) -> tuple[int, int | None]:
    """The largest m that ``runs`` and the smallest that does not, to within ``resolution`` (relative).

    Starts at ``start``, walks by factors of ``step`` until the answer flips, then bisects.
    Assumes ``runs`` holds below some size and fails above it. Returns ``(largest_ok, smallest_bad)``;
    ``largest_ok`` is 0 when even m = 1 fails, ``smallest_bad`` None when nothing up to ``limit`` failed.
    """
    m = max(1, start)
    if runs(m):
        ok, bad = m, None
        while bad is None:
            nxt = min(limit, max(ok + 1, int(ok * step)))
            if nxt == ok:
                return ok, None
            if runs(nxt):
                ok = nxt
            else:
                bad = nxt
    else:
        bad, ok = m, 0
        while ok == 0 and bad > 1:
            nxt = max(1, min(bad - 1, int(bad / step)))
            if runs(nxt):
                ok = nxt
            else:
                bad = nxt
        if ok == 0:
            return 0, bad
    while bad - ok > max(1, int(ok * resolution)):
        mid = (ok + bad) // 2
        if runs(mid):
            ok = mid
        else:
            bad = mid
    return ok, bad


def _loader_factory(spec: Spec, device: str, steps: int) -> Callable[[int], DataLoader]:
    pool = PoolDataset(spec.make_base(64), length=1 << 30)

    def make(batch_size: int) -> DataLoader:
        # enough for the run, no more: the Trainer stops at max_steps anyway; each loader its own length
        sized = pool.sized(batch_size * (steps + 2))
        return DataLoader(sized, batch_size=batch_size, shuffle=False, num_workers=spec.workers,
                          pin_memory=device == "cuda", persistent_workers=False)

    return make


def _release_process_group() -> None:
    """End the one-process group the fit started, so the next plan starts from a clean device.

    Its collectives hold the DDP gradient buckets of the fit that just ended (seen on an H100:
    1.34 GB for BERT-Large stayed allocated after the fit until the next plan's run), and a fit
    that followed another in the same group peaked one gradient size higher (BERT-Large m = 12:
    10.94 against 9.60 GB). The next Trainer starts a new group, so every plan runs as a first fit."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
        dist.destroy_process_group()
    gc.collect()


def _is_oom(error: str | None) -> bool:
    return bool(error) and ("OutOfMemoryError" in error or "out of memory" in error.lower())


def _seeded(make: Callable[[], L.LightningModule]) -> Callable[[], L.LightningModule]:
    def build() -> L.LightningModule:
        torch.manual_seed(0)
        return make()

    return build


def _profile_task(name: str, tiny: bool, device: str, steps: int) -> dict[str, Any]:
    """Profile one benchmark model (in the process it is called in); the profile as a dict."""
    spec = MODELS[name](tiny)
    module = _seeded(spec.make_module)()
    loader = _loader_factory(spec, device, steps)(spec.loader_batch)
    loader.dataset.length = 1 << 20
    t0 = time.perf_counter()
    profile = profile_module(module, loader, device=device, progress=lambda msg: print(f"  [{name}] {msg}", flush=True))
    seconds = time.perf_counter() - t0
    cuda = device == "cuda"
    return {"profile": profile.to_dict(), "profiling_s": seconds,
            "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
            "total_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None}


def _measure_task(name: str, tiny: bool, device: str, plan: Plan, steps: int, warmup: int, loader_steps: int) -> dict[str, Any]:
    """Train one dp_ga plan (in the process it is called in): ``measure_plan``'s raw numbers."""
    spec = MODELS[name](tiny)
    raw = measure_plan(plan, make_module=_seeded(spec.make_module), make_loader=_loader_factory(spec, device, loader_steps),
                       steps=steps, warmup=warmup, accelerator="cuda" if device == "cuda" else "cpu", devices=1, num_nodes=1)
    _release_process_group()
    raw["allocated_after_bytes"] = int(torch.cuda.memory_allocated()) if device == "cuda" else None
    return raw


def _child_main(conn: Any, task: Callable[..., dict[str, Any]], args: tuple) -> None:
    try:
        conn.send(("ok", task(*args)))
    except BaseException as err:  # noqa: BLE001 — reported to the parent, which records it
        conn.send(("error", f"{type(err).__name__}: {err}"))
    finally:
        conn.close()


def isolated(mode: str, task: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``task(*args)`` in a forked process of its own (``mode="fork"``) or in this one (``"none"``).

    A child that dies without an answer (a CUDA error that kills the process, say) raises here."""
    if mode == "none":
        return task(*args)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(child, task, args))
    proc.start()
    child.close()
    try:
        status, value = parent.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"{task.__name__}{args} died without an answer (exit code {proc.exitcode})") from None
    proc.join()
    if status != "ok":
        raise RuntimeError(f"{task.__name__}{args} failed: {value}")
    return value


def run_model(name: str, spec: Spec, args: argparse.Namespace, device: str, result: dict, save: Callable[[], None]) -> None:
    """Profile ``name``, then measure each point (and probe) in a process of its own, into ``result["models"][name]``."""
    loader_steps = args.warmup + args.steps
    got_profile = isolated(args.isolate, _profile_task, name, args.tiny, device, loader_steps)
    # the device as torch in the profiling process saw it (asked here, torch would start CUDA before the forks)
    result["device"].update(name=got_profile["device_name"], total_memory_bytes=got_profile["total_memory_bytes"])
    record = result["models"][name] = {}
    profile = Profile.from_dict(got_profile["profile"])
    profiling_s = got_profile["profiling_s"]
    hardware = Hardware.from_profile(profile)
    profiled = sorted(profile.micro_batch_sizes)
    record.update(what=spec.what, loader_batch_size=spec.loader_batch, profiled_micro_batch_sizes=profiled,
                  infeasible_micro_batch_sizes_while_profiling=sorted(profile.infeasible_micro_batch_sizes),
                  profiling_time_s=profiling_s, profile=profile.to_dict(), points=[])
    print(f"{name}: profiled m={profiled} in {profiling_s:.1f} s (fit R² fwd {profile.step.forward.r2:.3f}, bwd {profile.step.backward.r2:.3f})", flush=True)
    save()

    def measure(m: int, s: int, steps: int, warmup: int) -> dict:
        plan = Plan(strategy="dp_ga", dp=1, micro_batch_size=m, accumulate_grad_batches=s, global_batch_size=m * s)
        raw = isolated(args.isolate, _measure_task, name, args.tiny, device, plan, steps, warmup, loader_steps)
        timed = raw["step_times_s"][warmup:]
        return {"plan": plan, "error": raw["error"], "peak": raw["peak_memory_bytes"], "baseline": raw["baseline_memory_bytes"],
                "step": statistics.median(timed) if timed and not raw["error"] else None, "steps": timed,
                "allocated_after": raw["allocated_after_bytes"]}

    if not args.oom_only:
        # the profiling cost in steps of the loader's own batch
        base = measure(spec.loader_batch, 1, args.steps, args.warmup)
        record["loader_batch_step_time_s"] = base["step"]
        if base["step"]:
            record["profiling_cost_in_steps"] = profiling_s / base["step"]
            print(f"  profiling cost {profiling_s:.1f} s = {profiling_s / base['step']:.0f} optimizer steps at the loader's batch {spec.loader_batch}", flush=True)

        for m in unprofiled_sizes(profiled):
            for s in args.accumulations:
                got = measure(m, s, args.steps, args.warmup)
                pred = predict(profile, got["plan"], hardware)
                row = {"micro_batch_size": m, "accumulate_grad_batches": s, "predicted_feasible": pred.feasible,
                       "predicted_step_time_s": pred.step_time_s, "predicted_breakdown": dict(pred.breakdown),
                       "measured_step_time_s": got["step"], "measured_step_times_s": got["steps"], "error_message": got["error"],
                       "predicted_peak_memory_bytes": pred.peak_memory_bytes, "predicted_memory_breakdown": dict(pred.memory_breakdown),
                       "measured_peak_memory_bytes": got["peak"] if device == "cuda" else None,
                       "allocated_before_run_bytes": got["baseline"] if device == "cuda" else None}
                row["step_time_error"] = None if got["step"] is None else (pred.step_time_s - got["step"]) / got["step"]
                row["memory_error"] = None if not row["measured_peak_memory_bytes"] else (pred.peak_memory_bytes - got["peak"]) / got["peak"]
                record["points"].append(row)
                mem = "" if row["memory_error"] is None else (f"   peak predicted {pred.peak_memory_bytes / 2**30:6.2f} GiB measured "
                                                             f"{got['peak'] / 2**30:6.2f} GiB ({row['memory_error']:+.1%})")
                if got["step"] is None:
                    print(f"  m={m:4d} s={s}  FAILED: {got['error']}", flush=True)
                else:
                    print(f"  m={m:4d} s={s}  predicted {pred.step_time_s * 1e3:8.1f} ms   measured {got['step'] * 1e3:8.1f} ms   error {row['step_time_error']:+6.1%}{mem}", flush=True)
                save()

    if device == "cuda" and not args.no_oom_search:
        _oom_search(profile, hardware, measure, record, save)


def _oom_search(profile: Profile, hardware: Hardware, measure: Callable[..., dict], record: dict, save: Callable[[], None]) -> None:
    total = hardware.device_memory_bytes
    raw_max = predicted_largest_micro_batch(profile, hardware, total)
    planner_max = predicted_largest_micro_batch(profile, hardware, hardware.usable_memory_bytes)
    probes: list[dict] = []

    def runs(m: int) -> bool:
        got = measure(m, 1, 1, 1)
        probes.append({"micro_batch_size": m, "ran": got["error"] is None, "error": got["error"], "peak_memory_bytes": got["peak"],
                       "allocated_after_bytes": got["allocated_after"]})
        print(f"  OOM search: m={m} {'ran' if got['error'] is None else 'failed: ' + str(got['error'])[:80]} (peak {got['peak'] / 2**30:.1f} GiB)", flush=True)
        if got["error"] is not None and not _is_oom(got["error"]):
            raise RuntimeError(f"m={m} failed for a reason other than memory: {got['error']}")
        return got["error"] is None

    ok, bad = find_boundary(runs, raw_max)
    planner_runs = planner_max <= ok or runs(planner_max)
    record["oom"] = {
        "device_memory_bytes": total, "memory_margin": hardware.memory_margin,
        "predicted_largest_micro_batch_whole_device": raw_max, "predicted_largest_micro_batch_planner": planner_max,
        "measured_largest_micro_batch": ok, "measured_smallest_oom_micro_batch": bad,
        "boundary_error": (raw_max - ok) / ok if ok else None,
        "planner_largest_runs": planner_runs, "probes": probes,
    }
    print(f"  OOM boundary: predicted {raw_max} (whole device), planner allows up to {planner_max}; measured largest that ran {ok}, "
          f"smallest that ran out {bad}; planner's largest {'ran' if planner_runs else 'RAN OUT OF MEMORY'}", flush=True)
    save()


def summarize(models: dict) -> dict:
    points = [p for rec in models.values() for p in rec.get("points", [])]
    ran = [p for p in points if p["measured_step_time_s"] is not None]  # a run that failed has no step time or whole-run peak
    times = [abs(p["step_time_error"]) for p in ran]
    mems = [abs(p["memory_error"]) for p in ran if p["memory_error"] is not None]
    oom = [rec["oom"] for rec in models.values() if "oom" in rec]
    feasible_but_failed = [p for p in points if p["predicted_feasible"] and p["measured_step_time_s"] is None]
    out = {
        "n_points": len(points), "n_timed": len(times),
        "n_memory_within_5pct": sum(m <= 0.05 for m in mems),
        "failed_as_predicted": sum(not p["predicted_feasible"] for p in points if p["measured_step_time_s"] is None),
        "median_abs_step_time_error": statistics.median(times) if times else None,
        # linear interpolation, as distplan bench and the CPU sweeps take it (statistics.quantiles' default, used until
        # 2026-11-25, extrapolates past the largest error on few points: 473% where the largest was 351%, on 3 points)
        "p90_abs_step_time_error": percentile(times, 90),
        "max_abs_step_time_error": max(times) if times else None,
        "median_abs_memory_error": statistics.median(mems) if mems else None,
        "max_abs_memory_error": max(mems) if mems else None,
        "predicted_feasible_that_failed": len(feasible_but_failed) + sum(not o["planner_largest_runs"] for o in oom),
    }
    out["passed"] = (out["median_abs_step_time_error"] is not None and out["median_abs_step_time_error"] <= 0.10
                     and (out["max_abs_memory_error"] is None or out["max_abs_memory_error"] <= 0.05)
                     and out["predicted_feasible_that_failed"] == 0)
    return out


def default_out(device: str, device_name: str, *, tiny: bool, oom_only: bool) -> Path:
    """Where a run without ``--out`` writes: ``benchmarks/results/`` for a full-size CUDA run (the committed
    results the README's GPU rows are made from), ``runs/`` for a run on a CPU or with ``--tiny`` (a smoke run
    whose numbers must not appear there as a GPU's); ``_oom`` names a run of the boundary search alone."""
    slug = "".join(c if c.isalnum() else "_" for c in device_name.lower()).strip("_")
    name = f"gpu_validation_{slug}{'_tiny' if tiny else ''}{'_oom' if oom_only else ''}.json"
    return (ROOT / "benchmarks" / "results" if device == "cuda" and not tiny else ROOT / "runs") / name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,bert_large,resnet101", help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--accumulations", type=positive_ints, default=[1, 4], help="comma-separated, e.g. 1,4")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per point (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    parser.add_argument("--matmul-precision", default="high", choices=["highest", "high", "medium"])
    parser.add_argument("--no-oom-search", action="store_true", help="skip the out-of-memory boundary search")
    parser.add_argument("--oom-only", action="store_true", help="profile and search the out-of-memory boundary only (no points)")
    parser.add_argument("--tiny", action="store_true", help="small configs of the same architectures (a smoke run)")
    parser.add_argument("--isolate", choices=["fork", "none"], default="fork",
                        help="fork: profile and run each plan in a process of its own (default); none: all in this process")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device)
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    if args.oom_only and (device != "cuda" or args.no_oom_search):
        parser.error("--oom-only searches a CUDA device's out-of-memory boundary: it needs --device cuda (or a GPU) and no --no-oom-search")
    result: dict[str, Any] = {
        "benchmark": "gpu_validation",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": {"type": device, "name": None, "total_memory_bytes": None},  # filled in by the first profile
        "isolate": args.isolate,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                     "lightning": L.__version__, "lightning_distplan": lightning_distplan.__version__},
        "float32_matmul_precision": args.matmul_precision, "tiny": args.tiny,
        "steps": args.steps, "warmup": args.warmup, "models": {},
    }
    if args.out:
        result_path(args.out, "gpu_validation.json", script="gpu_validation")  # a bad --out is refused before the first profile
    # after the checks: a refused run leaves the process's settings as they were (the tests call main() in theirs)
    torch.set_float32_matmul_precision(args.matmul_precision)
    _quiet_lightning()

    def out_path() -> Path:
        return Path(args.out) if args.out else default_out(device, result["device"]["name"], tiny=args.tiny, oom_only=args.oom_only)

    said: list[bool] = []

    def save() -> None:
        result["summary"] = summarize(result["models"])
        if not said:  # the first save: the file's name is known once the first profile has named the device
            result_path(args.out, out_path(), script="gpu_validation", now=True)
            said.append(True)
        write_result(out_path(), result)

    for name in names:
        run_model(name, MODELS[name](args.tiny), args, device, result, save)
    save()
    device_name = result["device"]["name"]
    s = result["summary"]
    fmt = lambda x: "n/a" if x is None else f"{x:.1%}"  # noqa: E731
    print(f"\n{device_name}: step time median |error| {fmt(s['median_abs_step_time_error'])}, p90 {fmt(s['p90_abs_step_time_error'])}, "
          f"max {fmt(s['max_abs_step_time_error'])} over {s['n_timed']} points; peak memory median |error| {fmt(s['median_abs_memory_error'])}, "
          f"max {fmt(s['max_abs_memory_error'])}; predicted-feasible runs that failed: {s['predicted_feasible_that_failed']}")
    for name, rec in result["models"].items():
        if "oom" in rec:
            o = rec["oom"]
            print(f"  {name}: OOM boundary predicted {o['predicted_largest_micro_batch_whole_device']} (planner {o['predicted_largest_micro_batch_planner']}), "
                  f"measured {o['measured_largest_micro_batch']}..{o['measured_smallest_oom_micro_batch']}")
        print(f"  {name}: profiling {rec['profiling_time_s']:.1f} s" + (f" = {rec['profiling_cost_in_steps']:.0f} steps" if rec.get("profiling_cost_in_steps") else ""))
    print(f"wrote {out_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
