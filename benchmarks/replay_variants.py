"""Replay stored sweeps under cost-model variants that were tried and not kept (README "Limitations").

Each variant swaps one piece of ``lightning_distplan.costmodel._predict`` for the length of the
replay, then prints the pooled median / p90 |step-time error| and picks next to today's model:

* ``samples``: the whole-step forward and backward time at a profiled micro-batch size is that
  size's own measured time instead of the line through all sizes (interpolated between sizes).
* ``slot``: every pipeline stage pays a constant ``--slot-ms`` per micro-batch on top of its work
  (half in forward, half in backward) and of the runtime slot the model already charges (since
  0a60779; before it, this variant stood in for that term); ``--gpipe-slot-ms`` gives GPipe plans
  their own (``benchmarks/pipeline_slot_overhead.py`` measures GPipe's runtime dearer than 1F1B's).
* ``side-by-side``: pipeline hand-overs priced as over NCCL, the two directions of an exchange
  crossing side by side, instead of one after the other as over gloo's one TCP stream
  (``Hardware.p2p_one_stream``), i.e. the model before the stage programs (it then took 1F1B
  from eq. (1) less the warm-up overlap; the ``warmup`` variant that replayed without that
  overlap is at commit 4738953).
* ``no-1f1b-preference``: not a cost-model variant but the ranking before a41b298: near ties of
  one micro-batch keep the order of their predicted times instead of going to 1F1B over GPipe.
* ``links``: not a model variant but today's link fit: every stored link profile's latency and
  bandwidth are fitted again from its stored (bytes, seconds) medians with
  ``lightning_distplan.profiling._links._fit``, for sweeps measured before the fit changed.

Run:  python benchmarks/replay_variants.py samples benchmarks/results/earlier/cpu_cluster_sweep_*.json
      python benchmarks/replay_variants.py slot --slot-ms 0.8 benchmarks/results/earlier/cpu_cluster_sweep_*.json
      python benchmarks/replay_variants.py side-by-side benchmarks/results/cpu_cluster_sweep*.json benchmarks/results/earlier/cpu_cluster_sweep*.json
      python benchmarks/replay_variants.py no-1f1b-preference benchmarks/results/cpu_cluster_sweep*.json
      python benchmarks/replay_variants.py links benchmarks/results/earlier/cpu_cluster_sweep_*.json

A stopped sweep's ``.partial.json`` the globs also match is left out (and named).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import read_sweeps  # noqa: E402
from cpu_cluster_sweep import confirmed_picks, summarize_sweep  # noqa: E402
from replay_sweep import replay_setting, stored_profiles  # noqa: E402

import lightning_distplan.costmodel._predict as P  # noqa: E402
import lightning_distplan.planner._rank as ranking  # noqa: E402
from lightning_distplan.profiling._links import _fit, link_parameters  # noqa: E402


def _whole(profile: Any, which: str, m: int) -> float:
    """The profiled whole-step forward or backward time at m, interpolated between profiled sizes; the line outside them."""
    fit = profile.step.forward if which == "forward_s" else profile.step.backward
    by_size: dict[int, list[float]] = {}
    for s in profile.step.samples:  # a pooled profile holds each size once per profile: their mean
        by_size.setdefault(s.micro_batch_size, []).append(getattr(s, which))
    points = sorted((m_, sum(v) / len(v)) for m_, v in by_size.items())
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= m <= x1:
            return y0 + (y1 - y0) * (m - x0) / (x1 - x0)
    return P._monotone(fit, m, profile.micro_batch_sizes)


class _StageWork(list):
    """The per-layer forward or backward times of one prediction (so ``stage_sums`` can tell them apart)."""


@contextlib.contextmanager
def variant(name: str, slot_s: float = 0.0, gpipe_slot_s: float | None = None) -> Iterator[None]:
    """Swap the variant's piece of the cost model in for the ``with`` block (``gpipe_slot_s``: GPipe's slot, default ``slot_s``)."""
    saved = {k: getattr(P, k) for k in ("_step_compute", "_step_backward", "_layer_times", "stage_sums", "_predict_pipeline", "schedule_time")}
    near_tie_order = ranking.near_tie_order
    if name == "samples":
        def layer_times(profile: Any, m: int, scale: float) -> tuple[list[float], list[float]]:
            def calibrated(fits: list[Any], whole: float) -> list[float]:
                raw = [P._monotone(f, m, profile.micro_batch_sizes) for f in fits]
                return [scale * whole * r / sum(raw) for r in raw]
            return (calibrated([l.forward for l in profile.layers], _whole(profile, "forward_s", m)),
                    calibrated([l.backward for l in profile.layers], _whole(profile, "backward_s", m)))

        P._step_compute = lambda profile, m, scale: scale * (_whole(profile, "forward_s", m) + _whole(profile, "backward_s", m))
        P._step_backward = lambda profile, m, scale: scale * _whole(profile, "backward_s", m)
        P._layer_times = layer_times
    elif name == "slot":
        per_schedule = {"gpipe": slot_s if gpipe_slot_s is None else gpipe_slot_s}
        pricing: dict[str, float] = {}

        def pipeline(profile: Any, plan: Any, hw: Any) -> Any:
            pricing["slot"] = per_schedule.get(plan.schedule, slot_s)
            return saved["_predict_pipeline"](profile, plan, hw)

        P._predict_pipeline = pipeline
        P._layer_times = lambda *a: tuple(_StageWork(x) for x in saved["_layer_times"](*a))
        P.stage_sums = lambda values, boundaries: (
            tuple(x + pricing["slot"] / 2 for x in saved["stage_sums"](values, boundaries))
            if isinstance(values, _StageWork) else saved["stage_sums"](values, boundaries)
        )
    elif name == "side-by-side":
        P.schedule_time = lambda *args, **kwargs: saved["schedule_time"](*args, **{**kwargs, "shared_stream": False})
    elif name == "no-1f1b-preference":
        ranking.near_tie_order = lambda *args, preferred=None, **kwargs: near_tie_order(*args, **kwargs)
    else:
        raise SystemExit(f"unknown variant {name!r}. HINT: use samples, slot, side-by-side or no-1f1b-preference.")
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(P, k, v)
        ranking.near_tie_order = near_tie_order


def refit_links(doc: dict[str, Any]) -> dict[str, Any]:
    """A copy of a sweep document whose link profiles, those the replay predicts from, are fitted again from their stored medians."""
    doc = json.loads(json.dumps(doc))
    for setting in doc["settings"]:
        for profile in stored_profiles(setting) if "profile" in setting else []:
            for link in profile.get("links", []):
                sizes, times = zip(*link["samples"])
                _, (a, b) = _fit(list(sizes), list(times))
                link["latency_s"], link["bandwidth_bytes_per_s"] = link_parameters(link["kind"], link["world_size"], a, b)
    return doc


def _pooled(docs: list[dict[str, Any]]) -> str:
    replayed, rates = [], []
    for doc in docs:
        settings = [s for s in doc["settings"] if "profile" in s and "summary" in s]
        rates += [r for r in doc.get("provenance", {}).get("rates", []) if r not in rates]
        replayed += [replay_setting(s) for s in settings]
    s, _ = summarize_sweep(replayed, rates)
    picks = round(s["pick_within_5pct_rate"] * s["n_settings_done"])
    confirmed = f" ({confirmed_picks(s)} judged on the confirmation passes)" if confirmed_picks(s) else ""
    return f"median |error| {s['median_abs_error']:.1%}, p90 {s['p90_abs_error']:.1%}, pick within 5% in {picks}/{s['n_settings_done']} settings{confirmed}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variant", choices=("samples", "slot", "side-by-side", "no-1f1b-preference", "links"))
    parser.add_argument("sweeps", nargs="+", type=Path, help="sweep result JSON files (with stored profiles)")
    parser.add_argument("--slot-ms", type=float, default=0.8, help="the slot variant's cost per stage and micro-batch")
    parser.add_argument("--gpipe-slot-ms", type=float, default=None, help="the slot variant's cost for GPipe plans (default: --slot-ms)")
    args = parser.parse_args(argv)
    docs = [doc for _, doc in read_sweeps(args.sweeps, script="replay_variants")]
    print(f"today's model: {_pooled(docs)}")
    if args.variant == "links":
        again = [refit_links(d) for d in docs]
        fitted = lambda ds: [l for d in ds for s in d["settings"] if "profile" in s for p in stored_profiles(s) for l in p.get("links", [])]  # noqa: E731
        changed = sum(a != b for a, b in zip(fitted(docs), fitted(again)))
        print(f"links fitted again ({changed} of {len(fitted(docs))} stored link fits change): {_pooled(again)}")
        return 0
    gpipe = None if args.gpipe_slot_ms is None else args.gpipe_slot_ms / 1e3
    with variant(args.variant, args.slot_ms / 1e3, gpipe):
        shown = f" {args.slot_ms} ms" + (f" (GPipe {args.gpipe_slot_ms} ms)" if gpipe is not None else "") if args.variant == "slot" else ""
        print(f"{args.variant}{shown}: {_pooled(docs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
