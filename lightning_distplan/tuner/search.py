"""Search cloud configurations with Optuna over the fitted cost model (seed 000 §IV-D).

Search space (one trial = one configuration): ``instance_type`` (categorical), ``n_instances``
(1..max_instances), ``strategy`` (``dp_ga`` / ``gpipe`` / ``1f1b``; a pipeline with dp > 1 is the
hybrid), ``pp`` (pipelines only) and ``micro_batch_size`` (log scale). The sampled point is mapped
onto the nearest plan that :func:`~lightning_distplan.planner.enumerate_plans` lists for that world
size (:meth:`ConfigSpace.nearest_plan`), so every configuration a trial runs factors the global
batch exactly; accumulation (``accumulate_grad_batches`` or ``n_microbatches``) follows from the
other factors. The requested values stay in the trial's params, the plan that ran in its user
attributes.

Objective: C + w·T per optimizer step with TPESampler(seed) (single objective, the default; the
last :data:`POLISH_SHARE` of the trials go to a local search from TPE's best plan and from the best of each other strategy, :func:`_polish`,
and what it leaves back to TPE), or (C, T) with NSGAIISampler(seed) (``multi_objective=True``). Either way the reported Pareto front is
computed from *all feasible evaluated configurations* of the study, so it is the same kind of object
in both modes. A run with at least as many trials as configurations the study has not priced runs no sampler: it
prices each of those once (:func:`_unpriced`), stored as the trials a search that drew them stores.

Infeasible configurations (memory over the device's usable share, or a strategy with no plan on that
many devices) are recorded as trials in state PRUNED with ``feasible=False`` and the reason in their
user attributes — the sampler ranks them below every feasible trial.

Storage and atomicity: the storage URL is opened and checked (a real round trip) and an existing
study of that name is compared with this run's settings *before* any trial. Trials then run against
an in-memory study and are written to the storage in one transaction at the end
(:func:`lightning_distplan.tuner._storage.write_trials`), because per-trial SQLite commits cost
far more than the cost model itself. So a failed run writes nothing; a run stopped with Ctrl-C
writes the trials that finished before it (all or none of them, as one transaction), and says how
many. An existing study is only extended by a run with identical settings (the seed aside) whose cost model prices its
earlier trials as they are stored (a study made before a change of the model is not mixed with today's
predictions); otherwise it is refused (:class:`StudyConflictError`) and left as it was. The same holds for a study that
another run (a second worker of the same command) created under this run's study name while this one searched: this
run's trials are added to it. The price of this:
optuna-dashboard sees the trials when the run ends, not while it runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from lightning_distplan.errors import CatalogError, DistPlanError, InfeasiblePlanError, first_line
from lightning_distplan.plan import STRATEGIES, Plan, as_int
from lightning_distplan.planner._enumerate import _check_strategies
from lightning_distplan.profile import Profile
from lightning_distplan.tuner._space import ConfigSpace, TunedConfig
from lightning_distplan.tuner._storage import (
    StudyStorageError, claim_study_without_attrs, claims_studies, create_study_with_attrs, creates_studies_whole, delete_study_without_trials, open_storage, shown_url, worker_slot,
    write_trials,
)
from lightning_distplan.tuner.catalog import PRICINGS, Catalog, load_catalog, spot_priced, with_bandwidth

__all__ = ["TuneResult", "ExhaustiveResult", "StudyStorageError", "StudyConflictError", "tune", "exhaustive", "pareto_front", "TIME_WEIGHTS"]

log = logging.getLogger(__name__)

TIME_WEIGHTS = (0.0, 2.0**8, 2.0**12, 2.0**16)
"""The weights w of seed 000 §IV-D: C + w·T with w ∈ {0, 2^8, 2^12, 2^16}."""

SETTINGS_ATTR = "distplan_settings"
_SETTINGS_VERSION = 1


class StudyConflictError(DistPlanError, ValueError):
    """A study of that name exists with different settings (it is left untouched)."""


OBJECTIVES = {
    False: "C + w*T per optimizer step (seed 000 §IV-D)",
    True: "(C, T) per optimizer step (NSGA-II); best: the lowest C + w*T among the configurations found",
}
"""What a search minimised, by ``multi_objective``, as the JSON result says it."""

METRIC_NAMES = {False: ("cost_per_step + w*step_time_s",), True: ("cost_per_step", "step_time_s")}
"""The study's metric names (optuna-dashboard's axis and column labels for the trial values), by ``multi_objective``."""

@dataclass(frozen=True, kw_only=True)
class TuneResult:
    """What :func:`tune` found."""

    best: TunedConfig
    """Lowest objective C + w·T among the study's feasible configurations."""
    pareto: tuple[TunedConfig, ...]
    """Non-dominated (cost, time) configurations among the study's feasible ones, cheapest first."""
    study_name: str
    storage: str
    time_weight: float
    currency: str
    catalog: str
    n_trials: int
    """Trials this call ran."""
    n_study_trials: int
    """Trials in the study after this call, read back from the storage (more when it resumed a study, or when another run
    extended it meanwhile)."""
    n_evaluations: int
    """Distinct configurations this call priced with the cost model (repeated draws are cached)."""
    n_feasible: int
    """Distinct feasible configurations the whole study has priced (this run's and earlier runs')."""
    space_size: int
    """Configurations in the whole space (instances × counts × valid plans)."""
    elapsed_s: float
    resumed: bool = False
    sampler: str = "TPESampler"
    """The sampler's class, and ``+ local search (N trials)`` when :func:`_polish` ran, and ``(worker k of this study on this
    machine: seed S)`` for a run started while others ran on the study (:func:`worker_seed`); ``none: ...`` (why) when the
    run priced every configuration the study lacked instead."""
    pricing: str = "on-demand"
    """Which price the costs use: ``"on-demand"`` or ``"spot"``."""
    multi_objective: bool = False
    """The search minimised (C, T) with NSGA-II; :attr:`best` is still the lowest ``C + w·T`` it found."""
    projections: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Instance type -> projection summary (target, compute scale, uncertainty band and its basis)."""
    notes: tuple[str, ...] = ()
    """What to know about the catalog's figures (:meth:`~lightning_distplan.tuner.catalog.Catalog.caveats`): estimated
    GPU peaks, network bandwidths that are burst peaks."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "best": self.best.to_dict(),
            "pareto": [c.to_dict() for c in self.pareto],
            "study_name": self.study_name,
            "storage": self.storage,
            "objective": OBJECTIVES[self.multi_objective],
            "multi_objective": self.multi_objective,
            "time_weight": self.time_weight,
            "currency": self.currency,
            "catalog": self.catalog,
            "pricing": self.pricing,
            "sampler": self.sampler,
            "n_trials": self.n_trials,
            "n_study_trials": self.n_study_trials,
            "n_evaluations": self.n_evaluations,
            "n_feasible": self.n_feasible,
            "space_size": self.space_size,
            "elapsed_s": self.elapsed_s,
            "resumed": self.resumed,
            "projections": self.projections,
            "notes": list(self.notes),
        }


@dataclass(frozen=True, kw_only=True)
class ExhaustiveResult:
    """Every configuration of the space, priced (the reference the tuner is measured against)."""

    best: TunedConfig
    pareto: tuple[TunedConfig, ...]
    n_evaluations: int
    n_feasible: int
    elapsed_s: float
    configs: tuple[TunedConfig, ...] = field(default=(), repr=False)


def pareto_front(configs: Sequence[TunedConfig]) -> tuple[TunedConfig, ...]:
    """Feasible configurations not dominated in (cost per step, time per step), cheapest first.

    One entry per distinct (cost, time) point; ties keep the first seen.
    """
    pts = sorted((c for c in configs if c.feasible and math.isfinite(c.objective)), key=lambda c: (c.cost_per_step, c.step_time_s))
    front: list[TunedConfig] = []
    best_time = math.inf
    for c in pts:
        if c.step_time_s < best_time:
            front.append(c)
            best_time = c.step_time_s
    return tuple(front)


# ------------------------------------------------------------------------------------------ helpers
def _fingerprint(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _profile_fingerprint(profile: Profile, *, with_empty_unused: bool = False) -> str:
    """The profile's fingerprint; fields added since, at the value an older file loads with, do not change it
    (else every study made by an earlier version is refused as made from another profile). ``with_empty_unused``:
    as versions of 2026-11-25 to 11-28 fingerprinted it, an empty ``unused_parameters`` included."""
    data = profile.to_dict()
    added = [  # (where, field, the value an older file loads with)
        *((layer, "trainable_param_bytes", None) for layer in data["layers"]),
        *(() if with_empty_unused else ((data, "unused_parameters", ()),)),  # 2026-11-25
        *((layer, f"conv_flops_{part}_per_sample", 0.0) for layer in data["layers"] for part in ("forward", "backward")),  # 2026-11-28
        *((layer, f"output_saved{part}_bytes_per_sample", None) for layer in data["layers"] for part in ("", "_later")),  # 2026-11-28
        (data["device"], "tf32_matmul", None),
        (data["device"], "tf32_conv", None),
    ]
    for where, name, old in added:
        if name in where and where[name] == old:
            del where[name]
    return _fingerprint(data)


def _catalog_fingerprint(catalog: Catalog, *, with_sources: bool = False) -> str:
    """The catalog's rows, by default without where each came from: one CSV is one catalog, however its path was
    typed (``with_sources``: as versions before 2026-11-23 fingerprinted them)."""
    # network_burst (2026-11-29) says what kind of figure network_gbps is, not another figure: a study of a catalog made
    # before it existed is the same catalog
    return _fingerprint([{k: v for k, v in i.to_dict().items() if (with_sources or k != "source") and k != "network_burst"}
                         for i in catalog.instances])


def _as_now(old: Any, catalog: Catalog, profile: Profile) -> Any:
    """A study's stored settings as this version writes them, so a study made by an earlier one is extended:
    strategies in one order, the catalog fingerprinted without each row's source (the path as typed), and the
    profile without an empty ``unused_parameters``."""
    if not isinstance(old, dict):
        return old
    old = dict(old)
    if isinstance(old.get("strategies"), list):
        old["strategies"] = [s for s in STRATEGIES if s in old["strategies"]] + [s for s in old["strategies"] if s not in STRATEGIES]
    if old.get("catalog_fingerprint") == _catalog_fingerprint(catalog, with_sources=True):
        old["catalog_fingerprint"] = _catalog_fingerprint(catalog)
    if old.get("profile") == _profile_fingerprint(profile, with_empty_unused=True):
        old["profile"] = _profile_fingerprint(profile)
    return old


REPRICED_TRIALS = 32
"""Earlier trials of an extended study whose configurations are priced again before a trial runs (:func:`_priced_otherwise`)."""


def _priced_otherwise(previous: Sequence[Any], catalog: Catalog, space: Any, multi_objective: bool) -> str | None:
    """Which earlier trial this version's model prices otherwise (its stored value against today's), or None.

    The settings fingerprint the inputs (profile, catalog, B, w, ...), not the cost model: a study made by an earlier
    version with other equations would be extended with today's predictions, its best being yesterday's. Up to
    :data:`REPRICED_TRIALS` complete trials (the best among them) are priced again: the model is deterministic, so
    the same model gives the same numbers."""
    import optuna

    done = [t for t in previous if t.state == optuna.trial.TrialState.COMPLETE and t.values]
    if not done:
        return None
    step = max(1, len(done) // REPRICED_TRIALS)
    sample = done[::step][:REPRICED_TRIALS]
    if not multi_objective:
        sample.append(min(done, key=lambda t: t.values[0]))
    for t in sample:
        p = t.params
        try:
            inst = catalog.get(p["instance_type"])
            count = int(p["n_instances"])
            plan = space.nearest_plan(inst.world_size(count), p["strategy"], int(p.get("pp", 1)), int(p["micro_batch_size"]))
            config = None if plan is None else space.evaluate(inst, count, plan)
        except (KeyError, ValueError, TypeError):
            config = None
        if config is None or not config.feasible:
            return f"trial {t.number} ({p}) completed there, but this version finds no feasible plan for it"
        now = (config.cost_per_step, config.step_time_s) if multi_objective else (config.objective,)
        if any(not math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0) for a, b in zip(t.values, now)):
            return (f"trial {t.number} ({count} x {inst.instance_type}, {p['strategy']}) is stored as "
                    f"{', '.join(f'{v:.4g}' for v in t.values)} but this version prices it {', '.join(f'{v:.4g}' for v in now)}")
    return None


def _resolve_catalog(catalog: Catalog | str, bandwidth_gbps: float | None, pricing: str | None) -> Catalog:
    """The catalog a search prices: loaded by name or path, with the bandwidth override and the pricing applied."""
    if pricing is not None and pricing not in PRICINGS:
        raise CatalogError(f"Unknown pricing {pricing!r}.", hint=f"Use one of {', '.join(PRICINGS)}.")
    if not isinstance(catalog, Catalog):
        return load_catalog(catalog, bandwidth_gbps=bandwidth_gbps, pricing=pricing or "on-demand")
    if bandwidth_gbps is not None:  # a Catalog object: the override applies to it too
        catalog = with_bandwidth(catalog, bandwidth_gbps)
    if pricing == "spot":
        return spot_priced(catalog)
    if pricing == "on-demand" and catalog.pricing == "spot":
        raise CatalogError(
            f"Catalog {catalog.name!r} is priced at spot prices, and on-demand pricing was asked for.",
            hint="Load the catalog again without pricing='spot' (load_catalog), or pass pricing='spot'.",
        )
    return catalog


SEED_MAX = 2**32 - 1
"""Optuna's samplers take seeds in [0, 2**32 - 1] (numpy's RandomState)."""


def _validate(profile: Profile, global_batch_size: Any, time_weight: Any, n_trials: Any, max_instances: Any, seed: Any,
              max_pp: Any = None) -> None:
    if not isinstance(profile, Profile):
        raise InfeasiblePlanError(f"`profile` must be a Profile, got {type(profile).__name__}.", hint="Load one with Profile.load(path).")
    checks = [("global_batch_size", global_batch_size, 1), ("n_trials", n_trials, 1), ("max_instances", max_instances, 1), ("seed", seed, 0)]
    if max_pp is not None:
        checks.append(("max_pp", max_pp, 1))
    for name, value, low in checks:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InfeasiblePlanError(f"`{name}` must be an integer >= {low}, got {value!r}.", hint=f"Pass {name}= as an integer >= {low}, e.g. {name}={max(low, 1)}.")
    if seed > SEED_MAX:
        raise InfeasiblePlanError(f"`seed` must be at most 2**32 - 1 ({SEED_MAX}), got {seed}.", hint="Pass a smaller seed, e.g. seed=0.")
    from lightning_distplan.planner._enumerate import MAX_GLOBAL_BATCH

    if global_batch_size > MAX_GLOBAL_BATCH:  # the planner's limit, in this command's terms (its own names --world-size)
        raise InfeasiblePlanError(
            f"`global_batch_size` {global_batch_size} is above the {MAX_GLOBAL_BATCH} samples per optimizer step this planner handles.",
            hint="Check the number: --global-batch-size (global_batch_size=) counts the samples of one optimizer step over all devices.",
        )
    if not isinstance(time_weight, (int, float)) or not math.isfinite(time_weight) or time_weight < 0:
        raise InfeasiblePlanError(f"`time_weight` must be a non-negative number, got {time_weight!r}.", hint="Use e.g. 0, 256, 4096 or 65536 (seed 000 §IV-D).")


POLISH_SHARE = 0.2
"""Share of a single-objective search's trials kept for the local search from TPE's best (:func:`_polish`)."""


_ONE_DEVICE = "a pipeline needs at least 2 devices"
_WHY_NOT = {  # kind of pruning reason -> (how the message counts it, the HINT when it is the most common)
    "factor": ("have no plan that factors the global batch {B}",
               "Use a global batch size with more divisors (e.g. a power of 2), or allow more instances (--max-instances)."),
    "devices": ("are pipelines on one device",
                "Add dp_ga to --strategy, or allow more instances (--max-instances)."),
    "memory": ("do not fit in memory",
               "Allow more instances (--max-instances), pipelines, or bigger GPUs; or lower the global batch size."),
}


def _nothing_feasible(trials: Sequence[Any], name: str, global_batch_size: int) -> InfeasiblePlanError:
    """The error when no trial found a feasible configuration: what stopped them, counted, and the HINT for the most common."""
    from collections import Counter

    def kind(reason: str) -> str:
        return "factor" if "factors the global batch" in reason else "devices" if _ONE_DEVICE in reason else "memory"

    counts = Counter(kind(str(t.user_attrs.get("reason", ""))) for t in trials)
    parts = ", ".join(f"{n} {_WHY_NOT[k][0].format(B=global_batch_size)}" for k, n in counts.most_common())
    return InfeasiblePlanError(
        f"None of the {len(trials)} configurations tried is feasible: {parts} (study {name!r} keeps them with their reasons).",
        hint=_WHY_NOT[counts.most_common(1)[0][0]][1],
    )


def _existing_study(storage: Any, study_name: str) -> Any | None:
    import optuna

    try:
        storage.get_study_id_from_name(study_name)
    except KeyError:
        return None
    return optuna.load_study(study_name=study_name, storage=storage)


def _delete_command(name: str, storage: str) -> str:
    """The shell command that deletes study ``name`` from ``storage`` (a password in the URL shown as ``***``, and
    then said to be put back: run as shown, it failed to log in).

    ``--study-name=NAME``: a name that starts with ``-`` is read as an option after a space (argparse: "expected one argument")."""
    import shlex

    shown = shown_url(storage)
    command = f"`optuna delete-study --study-name={shlex.quote(name)} --storage={shlex.quote(shown)}`"
    return command + (", with your password in place of ***" if shown != storage else "")


def worker_seed(seed: int, worker: int) -> int:
    """The sampler seed of worker ``worker`` of a search run with ``seed``: ``seed`` itself for worker 0 (a run alone,
    so a run with a given seed is reproducible), else one derived from both (SHA-256 of ``"seed/worker"``).

    A run's worker number (:func:`~lightning_distplan.tuner._storage.worker_slot`) is how many other runs on the same
    study on this machine were running when it started: workers left on one seed drew the same trials (two
    ``distplan tune --trials 100`` started together stored 200 trials and 63 distinct configurations)."""
    if not worker:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/{worker}".encode()).digest()[:4], "big")


def _settings_differ(old: Any, settings: dict[str, Any]) -> str | None:
    """Why a study whose stored settings are ``old`` (as :func:`_as_now` reads them) is not extended with ``settings``, or None.

    The seed is not compared: it picks which configurations a run prices, not their prices, and workers of one search
    draw with seeds of their own (:func:`worker_seed`). The study keeps its creator's."""
    if not isinstance(old, dict):
        return "it was not created by `distplan tune`"
    newer = _newer_settings_version(old, settings)
    if newer is not None:
        # compared key by key, its settings read as differences ("pricing 'spot' -> None" for a key this version
        # does not know), and the HINT said to delete a study that its own version extends
        return f"it was written by a newer distplan (settings version {newer}; this one writes version {settings['version']})"
    differ = [k for k, v in settings.items() if k not in _UNCOMPARED and old.get(k) != v]
    differ += [k for k in old if k not in settings and k not in _UNCOMPARED]
    if not differ:
        return None
    return "settings differ: " + ", ".join(f"{k} {old.get(k)!r} -> {settings.get(k)!r}" for k in differ)


def _newer_settings_version(old: Any, settings: dict[str, Any]) -> int | None:
    """The settings version of a study a newer distplan wrote (``old``, its stored settings), else None."""
    version = old.get("version") if isinstance(old, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > settings["version"]:
        return version
    return None


_NEWER_HINT = "Extend it with the newer lightning_distplan that wrote it (pip install -U lightning_distplan)"
"""How a HINT about a study of a newer distplan begins: its trials are valid there, so not "delete the old study"."""


_UNCOMPARED = frozenset({"seed"})
"""Settings a study stores that a run extending it may change (:func:`_settings_differ`)."""


CREATOR_WAIT_S = 30.0
"""How long a run whose new study another run created meanwhile waits for that run to store the study's settings, where
studies are not created whole (:func:`~lightning_distplan.tuner._storage.create_study_with_attrs` fell back to Optuna's
public API, which creates a study first and sets its attributes after)."""


OPENING_WAIT_S = 5.0
"""How long a run that finds its study with neither user attributes nor trials waits for its settings before adopting
it, where it is as a creator stopped before its ``set_user_attr`` leaves it (:func:`_orphaned`), or else refusing it
(:func:`_tune`): where studies are created through Optuna's public API, that is a study another worker is creating,
between its ``optuna.create_study`` and its ``set_user_attr`` (milliseconds, longer while another run's write holds
SQLite's lock). Shorter than :data:`CREATOR_WAIT_S`, which keeps a finished search's trials: this run has searched
nothing yet, so a re-run loses nothing, and a study someone else made empty (``optuna create-study``) waits no longer.
Not waited where this Optuna creates studies whole (:func:`~lightning_distplan.tuner._storage.creates_studies_whole`,
the usual case): there such a study is someone else's, refused at once."""


def _created_meanwhile(storage: Any, study_name: str, wait_s: float) -> Any:
    """The study another run created under ``study_name`` while this one searched, once its creator has stored its
    settings, or as it is after ``wait_s``.

    A run of this version creates its study with its settings in one transaction, so a study without them is someone
    else's (``optuna create-study``, another program): read once (``wait_s`` 0) and refused at once; it was refused
    after 30 s. Only where this Optuna makes runs create a study first and set its settings after (a write of the other
    run may hold SQLite's lock meanwhile) is it waited for, :data:`CREATOR_WAIT_S`. A run of a version before
    2026-11-29 (which created it so) mid-way through its creation is refused as someone else's. A run that finds such a
    study when it starts waits for it too (:data:`OPENING_WAIT_S`), where this Optuna creates studies so."""
    import optuna

    deadline = time.monotonic() + wait_s
    while True:
        study = optuna.load_study(study_name=study_name, storage=storage)
        if SETTINGS_ATTR in study.user_attrs or time.monotonic() > deadline:
            return study
        time.sleep(0.05)


def _orphaned(store: Any, study: Any, directions: list[Any], named: bool) -> bool:
    """Whether ``study`` (found without user attributes or trials, and waited for) is as a run of this search creating
    it through Optuna's public API leaves it when stopped before its first ``set_user_attr``: under this search's own
    default name (``named``: the user passed ``--study-name``), no system attribute either (Optuna's own, e.g. metric
    names, or another program's), this search's directions, and a storage where the claim
    (:func:`~lightning_distplan.tuner._storage.claim_study_without_attrs`) is one transaction.

    Why the default name only: a study made empty by hand (``optuna.create_study(storage=...)``, minimizing as Optuna's
    default) looks byte for byte like a killed creator's; under a name the user chose it may be meant for another search
    of theirs, so it is refused as before (the HINT names the command that deletes it), never filled with this one's
    trials. The default name (``distplan-<catalog>-B<batch>-w<weight>``) is distplan's own."""
    return (not named and study.directions == directions and not store.get_study_system_attrs(study._study_id)
            and claims_studies(store))


def _unset_study_error(name: str, storage: str) -> StudyConflictError:
    """The refusal of a study that stayed without settings or trials while this run waited, and is not one to adopt."""
    return StudyConflictError(
        f"Study {name!r} already exists in {shown_url(storage)!r} with neither distplan's settings nor trials, and no run creating "
        f"it stored its settings in the {OPENING_WAIT_S:g} s this run waited; it was left untouched.",
        hint="If another `distplan tune` is creating it, re-run the same command; else pass a new --study-name, or delete the "
        f"empty study ({_delete_command(name, storage)}).",
    )


def _trials_as_stored(storage: Any, study_name: str, searched: list[Any]) -> list[Any]:
    """The study's trials read back from ``storage`` after this run wrote its own, else ``searched`` (this run's view).

    This run read the study when it started and appended its trials when it ended: another ``distplan tune`` that
    extended the same study in between wrote trials this run never saw, and the numbers this run's trials got in the
    database follow them. Counted from ``searched``, the result said the study had fewer trials and feasible
    configurations than it had, its best left out the other run's, and its trial numbers named other trials."""
    import optuna

    try:
        stored = optuna.load_study(study_name=study_name, storage=storage).get_trials(deepcopy=False)
    except Exception as err:  # noqa: BLE001 - the trials are written; a failed read-back must not turn that into an error
        log.warning("Reading study %r back after writing this run's trials failed (%s: %s); the result counts the study as this run "
                    "saw it, without trials another run wrote meanwhile.", study_name, type(err).__name__, first_line(err)[:200])
        return searched
    return stored if len(stored) >= len(searched) else searched


def _existing_study_gone(storage: Any, study_name: str) -> bool:
    """Whether the study named ``study_name`` is no longer in ``storage`` (False when that cannot be read)."""
    try:
        storage.get_study_id_from_name(study_name)
    except KeyError:
        return True
    except Exception:  # noqa: BLE001 - a database that cannot answer: the original error is reported
        return False
    return False


@contextlib.contextmanager
def _signals_held() -> Iterator[list[int]]:
    """Hold a Ctrl-C or SIGTERM that arrives in the block (the list collects them) instead of letting it stop a
    write half-way: a study this run created is deleted again when its write fails, so an interrupt there lost
    every trial. A second one stops the write at once (the database may be waiting minutes on a lock), as before.
    Only in the main thread (where Python runs signal handlers); ignored signals stay ignored."""
    import signal
    import threading

    caught: list[int] = []
    previous: dict[int, Any] = {}

    def hold(signum: int, frame: object) -> None:
        caught.append(signum)
        if len(caught) > 1:
            raise KeyboardInterrupt
        print("distplan tune: writing this run's trials first; interrupt again to stop now without them", file=sys.stderr, flush=True)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(sig)
            if handler is not None and handler != signal.SIG_IGN:
                previous[sig] = handler
                signal.signal(sig, hold)
    try:
        yield caught
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _deliver(held: list[int]) -> bool:
    """Deliver the signals :func:`_signals_held` held to the handlers they would have reached; True when one raised
    KeyboardInterrupt (Python's Ctrl-C, the tune command's SIGTERM). A SIGTERM nobody handles ends the process, after
    the write."""
    import signal

    try:
        for sig in dict.fromkeys(held):
            signal.raise_signal(sig)
    except KeyboardInterrupt:
        return True
    return False


@contextlib.contextmanager
def _reading_study(url: str, study_name: str) -> Iterator[None]:
    """Turn a database that fails while the study is read (a damaged SQLite file, a lost server) into one
    :class:`StudyStorageError`; opening it already went through one round trip (``open_storage``)."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except (optuna.exceptions.StorageInternalError, SQLAlchemyError) as err:
        cause = err.__cause__ or err.__context__ or err
        raise StudyStorageError(
            f"Reading study {study_name!r} from {shown_url(url)!r} failed ({type(cause).__name__}: {first_line(cause)[:200]}); nothing was searched or written.",
            hint="The database may be damaged (for SQLite: sqlite3 FILE 'PRAGMA integrity_check'); keep a copy, and pass another --storage or restore one.",
        ) from None


def _initial_design(types: Sequence[str], max_instances: int, global_batch_size: int, strategies: Sequence[str]) -> list[dict[str, Any]]:
    """Two corners per instance type, tried first: one instance with the whole batch in one micro-batch, and
    the most instances with micro-batch 1 (the sampler's own draws follow). Data parallel where it is
    searched, else the first pipeline strategy with 2 stages.

    Why: the cost surface is deceptive at its edges - C + w·T is often lowest for a single instance
    (no all-reduce at all) or for the most instances, and an instance type whose average trial is poor
    is rarely revisited by TPE - so the search starts from those edges for every type
    (a deterministic initial design; the seed still drives everything after it).
    """
    plan: dict[str, Any] = {"strategy": "dp_ga"} if "dp_ga" in strategies else {"strategy": strategies[0], "pp": 2}
    points: list[dict[str, Any]] = []
    for t in types:
        points.append({"instance_type": t, "n_instances": 1, **plan, "micro_batch_size": global_batch_size})
    for t in types:
        points.append({"instance_type": t, "n_instances": max_instances, **plan, "micro_batch_size": 1})
    return points


def _neighbours(params: dict[str, Any], types: Sequence[str], max_instances: int, global_batch_size: int,
                strategies: Sequence[str], pp_hi: int) -> list[dict[str, Any]]:
    """The search points one step from ``params``: each number halved or doubled (the instance count with the
    micro-batch the other way too, which keeps the per-device batch), another strategy, another instance type."""
    t, n, s, m = params["instance_type"], params["n_instances"], params["strategy"], params["micro_batch_size"]
    pp = params.get("pp", 1)

    def point(**change: Any) -> dict[str, Any]:
        new = {"instance_type": t, "n_instances": n, "strategy": s, "pp": pp, "micro_batch_size": m, **change}
        if new["strategy"] == "dp_ga":
            new.pop("pp")
        elif new["pp"] < 2:
            new["pp"] = 2
        return new

    def clamp(x: int, low: int, high: int) -> int:  # a doubling past the edge stops at it (20 instances of 24: 24)
        return max(low, min(high, x))

    out: list[dict[str, Any]] = []
    moves = ((n * 2, m), (n // 2, m), (n, m * 2), (n, m // 2), (n * 2, m // 2), (n // 2, m * 2))
    for n2, m2 in dict.fromkeys((clamp(a, 1, max_instances), clamp(b, 1, global_batch_size)) for a, b in moves):
        if (n2, m2) != (n, m):
            out.append(point(n_instances=n2, micro_batch_size=m2))
    if s != "dp_ga":
        out.extend(point(pp=p2) for p2 in dict.fromkeys((clamp(pp * 2, 2, pp_hi), clamp(pp // 2, 2, pp_hi))) if p2 != pp)
    out.extend(point(strategy=other) for other in strategies if other != s)
    out.extend(point(instance_type=other) for other in types if other != t)
    return out


def _plan_point(trial: Any) -> dict[str, Any]:
    """The search point of the plan a trial ran (a trial's parameters are mapped to the nearest valid plan, so its
    own ``pp`` / ``micro_batch_size`` may be far from the plan's: steps from the plan are steps in the plan space)."""
    attrs, point = trial.user_attrs, dict(trial.params)
    if all(k in attrs for k in ("strategy", "pp", "micro_batch_size", "count")):
        point.update(n_instances=attrs["count"], strategy=attrs["strategy"], micro_batch_size=attrs["micro_batch_size"])
        if attrs["strategy"] == "dp_ga":
            point.pop("pp", None)
        else:
            point["pp"] = attrs["pp"]
    return point


def _point_key(params: dict[str, Any]) -> tuple:
    return tuple(sorted(params.items()))


def _polish(study: Any, objective_fn: Callable[[Any], Any], budget: int, neighbours: Callable[[dict[str, Any]], list[dict[str, Any]]],
            callbacks: Sequence[Callable[[Any, Any], None]] = ()) -> int:
    """Local search from the best trial: try its untried neighbours, move to the best of them while it improves;
    then the same from the best trial of each other strategy, while the budget lasts.

    Why: TPE finds the region of the optimum but, with one seed in four on a real profile, settled 28% above it
    (8 instances of data parallel where 32 with a 2-stage 1F1B pipeline were best); the optimum was a few
    doublings away. From data parallel no single step towards it improved, once DDP's buckets were priced in
    ready order (two seeds in four stopped 35% above it): the climb from the best pipeline trial reaches it.
    Returns the trials it used (at most ``budget``)."""
    import optuna

    used = 0
    tried = {_point_key(t.params) for t in study.trials}

    def complete() -> list[Any]:
        return [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]

    def key(t: Any) -> tuple[float, float]:
        # ties on C + w·T go to the faster trial, as the result's best does: on free (price 0) instances with w = 0
        # every objective is 0, and the climb stopped at its first step, never reaching a faster configuration
        step = t.user_attrs.get("step_time_s")
        return t.value, math.inf if step is None else step

    def climb(best: Any) -> None:
        nonlocal used
        while used < budget:
            todo = [p for p in neighbours(_plan_point(best)) if _point_key(p) not in tried][: budget - used]
            if not todo:
                return
            for p in todo:
                tried.add(_point_key(p))
                study.enqueue_trial(p)
            study.optimize(objective_fn, n_trials=len(todo), gc_after_trial=False, callbacks=list(callbacks))
            used += len(todo)
            ran = [t for t in study.trials[-len(todo):] if t.state == optuna.trial.TrialState.COMPLETE]
            better = min(ran, key=key, default=None)
            if better is None or key(better) >= key(best):
                return
            best = better

    if not complete():
        return 0
    climbed: set[Any] = set()
    while used < budget:
        by_strategy: dict[Any, Any] = {}
        for t in sorted(complete(), key=key):
            by_strategy.setdefault(t.user_attrs.get("strategy"), t)
        start = next((t for s, t in by_strategy.items() if s not in climbed), None)
        if start is None:
            break
        climbed.add(start.user_attrs.get("strategy"))
        climb(start)
    return used


class _TrialBar:
    """A progress bar (stderr) over all of a search's trials, with the best objective so far.

    Optuna's own bar covers one ``optimize`` call; a single-objective search makes several (TPE, then
    :func:`_polish`, then TPE for what is left), and the bar should neither stop short nor restart."""

    def __init__(self, total: int, multi_objective: bool, *, enabled: bool) -> None:
        self._multi = multi_objective
        self._best: float | None = None
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc="tune", unit="trial", file=sys.stderr, dynamic_ncols=True)

    def __call__(self, study: Any, trial: Any) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        if not self._multi and trial.value is not None and (self._best is None or trial.value < self._best):
            self._best = trial.value
            self._bar.set_postfix_str(f"best objective {self._best:.6g} (trial {trial.number})", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _config_from_trial(trial: Any) -> TunedConfig | None:
    attrs = trial.user_attrs
    if not attrs.get("feasible") or attrs.get("objective") is None:
        return None
    try:
        return TunedConfig.from_attrs(attrs, trial_number=trial.number)
    except (KeyError, TypeError, ValueError):
        return None


def _unpriced(space: ConfigSpace, previous: Sequence[Any]) -> list[tuple[Any, int, Plan]]:
    """The configurations of ``space`` that no trial of ``previous`` priced (all of them for a new study)."""
    fields = ("instance_type", "count", "strategy", "dp", "pp", "micro_batch_size")
    priced = {tuple(t.user_attrs.get(k) for k in fields) for t in previous}
    return [(inst, count, plan) for inst, count, plan in space.configurations()
            if (inst.instance_type, count, plan.strategy, plan.dp, plan.pp, plan.micro_batch_size) not in priced]


def _every_configuration(n_trials: int, left: int) -> str:
    """What :attr:`TuneResult.sampler` says of a run that priced every configuration left (no sampler ran)."""
    if not left:
        return f"none: the study had priced every configuration already, so this run priced none ({n_trials} trials asked)"
    return f"none: {n_trials} trials asked >= the {left} configurations left to price, so each was priced once"


def _priced_trial(space: ConfigSpace, inst: Any, count: int, plan: Plan, distributions: dict[str, Any], multi_objective: bool) -> Any:
    """The trial a search that drew exactly this configuration stores: its plan as the parameters (the nearest plan
    to them is itself, so an extending run prices it again as :func:`_priced_otherwise` does), the search's
    distributions, the same user attributes; PRUNED when it is infeasible."""
    import optuna

    config = space.evaluate(inst, count, plan)
    params = {"instance_type": inst.instance_type, "n_instances": count, "strategy": plan.strategy, "pp": plan.pp,
              "micro_batch_size": plan.micro_batch_size}
    if plan.strategy == "dp_ga":
        params.pop("pp")
    requested = {"strategy": plan.strategy, "pp": plan.pp, "micro_batch_size": plan.micro_batch_size}
    attrs = space.trial_attrs(config, inst, requested=requested)
    values = None
    if config.feasible:
        values = [config.cost_per_step, config.step_time_s] if multi_objective else [config.objective]
    return optuna.trial.create_trial(
        state=optuna.trial.TrialState.COMPLETE if config.feasible else optuna.trial.TrialState.PRUNED,
        values=values, params=params, distributions={k: distributions[k] for k in params}, user_attrs=attrs,
    )


# ------------------------------------------------------------------------------------------ tune
def tune(
    profile: Profile,
    *,
    catalog: Catalog | str,
    global_batch_size: int,
    time_weight: float = 0.0,
    n_trials: int = 300,
    storage: str = "sqlite:///distplan.db",
    study_name: str | None = None,
    seed: int = 0,
    max_instances: int = 8,
    strategies: Sequence[str] = STRATEGIES,
    max_pp: int | None = None,
    multi_objective: bool = False,
    precision: str = "auto",
    bandwidth_gbps: float | None = None,
    pricing: str | None = None,
    progress: bool = True,
    sampler: Any = None,
    initial_design: bool = True,
) -> TuneResult:
    """Search instance type, count, strategy, stages and micro-batch size for the lowest C + w·T.

    Args:
        profile: the measured profile (any device; it is projected to each catalog GPU).
        catalog: a :class:`Catalog`, a built-in name (``"alicloud-2023"``, ``"aws-2026"``) or a CSV path.
        global_batch_size: the user's batch per optimizer step; every configuration factors it exactly.
        time_weight: w in C + w·T (seed 000 §IV-D uses 0, 2^8, 2^12, 2^16); C is in the catalog currency.
        n_trials: trials to run in this call. When it is at least the number of configurations the study has not priced
            (the whole space for a new study), no sampler runs: each of those is priced once and stored as a trial
            (without a ``sampler`` passed; the result's ``sampler`` says so, and ``n_trials`` how many were priced).
        storage: any Optuna RDB URL; SQLite by default.
        study_name: default ``distplan-<catalog>-B<global batch>-w<weight>`` (``-mo`` after it with ``multi_objective``). An existing study with the same
            settings is extended; one with different settings is refused (:class:`StudyConflictError`). An empty name is refused.
        seed: seeds the sampler (TPESampler, or NSGAIISampler with ``multi_objective``); a run with another seed extends
            the study. A run alone on its study uses ``seed`` itself, so it is reproducible; a run started while k others
            run on the same study on this machine (workers of one search) is worker k and draws with a seed derived from
            ``seed`` and k (:func:`worker_seed`; the result's ``sampler`` names it), and leaves the initial design to
            worker 0, so workers spread out instead of pricing the same trials. Workers on other machines (a database
            server) do not see each other: give each its own seed. A single-objective search of
            20 or more trials keeps the last fifth (:data:`POLISH_SHARE`) for a local search from TPE's best plan
            (:func:`_polish`); the result's ``sampler`` says how many trials it used.
        max_instances: the most instances of one type to rent.
        strategies / max_pp: restrict the plans (as :func:`~lightning_distplan.planner.enumerate_plans`).
        multi_objective: optimise (cost, time) with NSGA-II instead of C + w·T with TPE.
        precision: projection math, see :func:`~lightning_distplan.costmodel.projection.project_profile`.
        bandwidth_gbps: override every instance's network bandwidth (Gbit/s).
        pricing: ``"on-demand"`` or ``"spot"`` (the catalog's ``SpotPrice``; instances without one are left out, see
            :func:`~lightning_distplan.tuner.catalog.spot_priced`). Default: on-demand for a catalog by name or path,
            as priced for a :class:`Catalog`. The default study name then carries ``-spot`` (the catalog's name).
        progress: show a progress bar over all trials, with the best objective so far (stderr).
        sampler: an Optuna sampler to use instead of the seeded default (for experiments).
        initial_design: start a new study with two corner trials per instance type (see
            :func:`_initial_design`; at most a quarter of ``n_trials``).

    Raises:
        CatalogError: unknown or malformed catalog, or spot pricing asked of one without spot prices.
        StudyStorageError: invalid or unreachable storage (nothing is run).
        StudyConflictError: the study exists with other settings (it is left untouched).
        InfeasiblePlanError: bad arguments, or no evaluated configuration fits in memory.
        ModelSplitError: only pipeline strategies are requested and the profile cannot be split into stages.
        KeyboardInterrupt: a Ctrl-C during the search, after the trials finished before it were written to
            the study (its message says how many; a new study is created only when one had finished).
    """
    import optuna

    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # Optuna's INFO line per trial and per study would drown the output
    try:
        with contextlib.ExitStack() as slots:
            return _tune(
                profile, catalog=catalog, global_batch_size=global_batch_size, time_weight=time_weight, n_trials=n_trials, storage=storage,
                study_name=study_name, seed=seed, max_instances=max_instances, strategies=strategies, max_pp=max_pp,
                multi_objective=multi_objective, precision=precision, bandwidth_gbps=bandwidth_gbps, pricing=pricing, progress=progress,
                sampler=sampler, initial_design=initial_design, slots=slots,
            )
    finally:
        optuna.logging.set_verbosity(level)


def _tune(
    profile: Profile,
    *,
    catalog: Catalog | str,
    global_batch_size: int,
    time_weight: float,
    n_trials: int,
    storage: str,
    study_name: str | None,
    seed: int,
    max_instances: int,
    strategies: Sequence[str],
    max_pp: int | None,
    multi_objective: bool,
    precision: str,
    bandwidth_gbps: float | None,
    pricing: str | None,
    progress: bool,
    sampler: Any,
    initial_design: bool,
    slots: contextlib.ExitStack,
) -> TuneResult:
    import optuna

    started = time.perf_counter()
    _validate(profile, global_batch_size, time_weight, n_trials, max_instances, seed, max_pp)
    if type(multi_objective).__module__ == "numpy" and type(multi_objective).__name__ in ("bool", "bool_"):
        multi_objective = bool(multi_objective)  # numpy's True (a mask's element), taken before the check below
    if not isinstance(multi_objective, bool):  # "no" is true: an NSGA-II search nobody asked for
        raise InfeasiblePlanError(
            f"`multi_objective` must be True or False, got {multi_objective!r}.", hint="Pass multi_objective=True for the (cost, time) search, or leave it out."
        )
    if study_name is not None and not isinstance(study_name, str):
        raise InfeasiblePlanError(f"`study_name` must be a string or None, got {study_name!r}.", hint="Pass e.g. study_name='resnet101', or None for the default name.")
    if study_name is not None and not study_name.strip():  # `or` below would quietly take the default name instead
        raise InfeasiblePlanError(f"`study_name` must not be empty, got {study_name!r}.", hint="Pass e.g. study_name='resnet101', or study_name=None for the default name.")
    strategies = _check_strategies(strategies)  # before the space, which would read [] as "no configuration factors the batch"
    catalog = _resolve_catalog(catalog, bandwidth_gbps, pricing)
    space = ConfigSpace(
        profile, catalog, global_batch_size=global_batch_size, time_weight=float(time_weight), max_instances=max_instances,
        strategies=strategies, max_pp=max_pp, precision=precision,
    )
    space_size = space.size
    if space_size == 0 and "dp_ga" not in space.strategies and space.max_pp_value < 2:
        raise InfeasiblePlanError(
            f"Only pipelines ({', '.join(space.strategies)}) are searched, but no pipeline fits the limits: a pipeline needs 2 or more "
            f"stages, and at most {space.max_pp_value} are allowed (--max-pp, the profile's {len(profile.layers)} layers, "
            f"{max_instances} instances).",
            hint="Raise --max-pp (or --max-instances), or add dp_ga to --strategy.",
        )
    if space_size == 0:
        raise InfeasiblePlanError(
            f"No configuration of up to {max_instances} instances factors the global batch size {global_batch_size}.",
            hint="Raise --max-instances or use a global batch size with more divisors.",
        )
    # Project once per instance type now: an unknown profiled GPU fails here, before any trial.
    projections = {inst.instance_type: space.projection(inst)[1].to_dict() for inst in catalog.instances}
    settings = {
        "version": _SETTINGS_VERSION,
        "profile": _profile_fingerprint(profile),
        "model": profile.model,
        "catalog": catalog.name,
        "catalog_fingerprint": _catalog_fingerprint(catalog),
        "global_batch_size": global_batch_size,
        "time_weight": float(time_weight),
        "max_instances": max_instances,
        "strategies": [s for s in STRATEGIES if s in space.strategies],  # the set, in one order however typed
        "max_pp": max_pp,
        "multi_objective": bool(multi_objective),
        "precision": precision,
        "seed": seed,
    }
    # a multi-objective study has two values per trial: its own default name, so one never meets the other
    name = study_name or f"distplan-{catalog.name}-B{global_batch_size}-w{time_weight:g}" + ("-mo" if multi_objective else "")
    store = open_storage(storage)
    worker = slots.enter_context(worker_slot(storage, name))  # 0 for a run alone; held until this run has written its trials
    with _reading_study(storage, name):
        existing = _existing_study(store, name)
        previous = existing.get_trials(deepcopy=False) if existing is not None else []
        unset = existing is not None and not existing.user_attrs and not previous and not creates_studies_whole(store)
        if unset:
            # Created through Optuna's public API, another worker's study is without its settings until that worker sets
            # them: it was refused at once as not distplan's. One with trials or attributes of its own is someone else's,
            # and so is an empty one where this Optuna creates studies whole (a worker's is never without its settings).
            log.info("Study %r exists without settings or trials; waiting up to %g s for the run creating it to store its settings.",
                     name, OPENING_WAIT_S)
            try:
                existing = _created_meanwhile(store, name, wait_s=OPENING_WAIT_S)
            except KeyError:  # its creator's write failed and it deleted the study again: this run creates it
                existing = None
            previous = existing.get_trials(deepcopy=False) if existing is not None else []
        old = _as_now(existing.user_attrs.get(SETTINGS_ATTR), catalog, profile) if existing is not None else None
    minimize = [optuna.study.StudyDirection.MINIMIZE] * (2 if multi_objective else 1)
    orphan = False  # the empty study a creator killed before its set_user_attr left: adopted at the write, as if created
    if existing is not None:
        why = _settings_differ(old, settings)
        if why is not None and unset and not existing.user_attrs and not previous and _orphaned(store, existing, minimize, named=study_name is not None):
            log.info("Study %r stayed without settings, trials or system attributes for %g s: a run creating it was stopped before "
                     "storing its settings; this run adopts it.", name, OPENING_WAIT_S)
            existing, orphan, why = None, True, None
        elif why is not None and unset and not existing.user_attrs and not previous:
            raise _unset_study_error(name, storage)
        if why is not None:
            raise StudyConflictError(
                f"Study {name!r} already exists in {shown_url(storage)!r} and {why}; it was left untouched.",
                hint=f"{_NEWER_HINT}, or pass a new --study-name." if _newer_settings_version(old, settings) is not None
                else f"Pass a new --study-name, or delete the old study ({_delete_command(name, storage)}).",
            )
        repriced = _priced_otherwise(previous, catalog, space, bool(multi_objective))
        if repriced is not None:
            raise StudyConflictError(
                f"Study {name!r} already exists in {shown_url(storage)!r} with these settings, but its trials were priced by another "
                f"version of the cost model ({repriced}); it was left untouched.",
                hint=f"Pass a new --study-name (a fresh search takes seconds), or delete the old study ({_delete_command(name, storage)}).",
            )

    directions = ["minimize", "minimize"] if multi_objective else ["minimize"]
    chosen = sampler
    if sampler is None:
        run_seed = worker_seed(seed, worker)
        sampler = optuna.samplers.NSGAIISampler(seed=run_seed) if multi_objective else optuna.samplers.TPESampler(seed=run_seed)
    memory_study = optuna.create_study(directions=directions, sampler=sampler, study_name=name)
    n_before = 0
    if existing is not None:
        memory_study.add_trials(previous)
        n_before = len(previous)

    types = list(catalog.instance_types)
    pp_hi = space.max_pp_value
    pipelines = [s for s in space.strategies if s != "dp_ga"] if pp_hi >= 2 else []
    strategy_choices = [s for s in space.strategies if s == "dp_ga" or s in pipelines]

    def objective_fn(trial: Any) -> Any:
        itype = trial.suggest_categorical("instance_type", types)
        count = trial.suggest_int("n_instances", 1, max_instances, log=True)
        strategy = trial.suggest_categorical("strategy", strategy_choices)
        pp = trial.suggest_int("pp", 2, pp_hi, log=True) if strategy != "dp_ga" else 1
        m = trial.suggest_int("micro_batch_size", 1, global_batch_size, log=True)
        inst = catalog.get(itype)
        world = inst.world_size(count)
        requested = {"strategy": strategy, "pp": pp, "micro_batch_size": m}
        plan = space.nearest_plan(world, strategy, pp, m)
        if plan is None:
            trial.set_user_attr("feasible", False)
            trial.set_user_attr("instance_type", itype)
            trial.set_user_attr("count", count)
            trial.set_user_attr("world_size", world)
            if strategy != "dp_ga" and world < 2:
                reason = f"{_ONE_DEVICE} ({count} x {itype} has 1)"
            else:
                reason = f"no {strategy} plan factors the global batch {global_batch_size} on {world} device{'s' if world != 1 else ''}"
            trial.set_user_attr("reason", reason)
            raise optuna.TrialPruned()
        config = space.evaluate(inst, count, plan)
        for key, value in space.trial_attrs(config, inst, requested=requested).items():
            trial.set_user_attr(key, value)
        if not config.feasible:
            raise optuna.TrialPruned()
        return (config.cost_per_step, config.step_time_s) if multi_objective else config.objective

    # With at least as many trials as configurations left to price, a sampler mostly draws priced ones again (2000 TPE
    # trials took 193 s and priced 239 of 264 configurations): each is priced once instead (all 264 in about a second).
    todo = _unpriced(space, previous) if chosen is None and n_trials + len(previous) >= space_size else None
    every = todo is not None and n_trials >= len(todo)
    if existing is None and initial_design and not every and not (chosen is None and worker):  # worker 0 tries the corners
        for point in _initial_design(types, max_instances, global_batch_size, strategy_choices)[: max(0, n_trials // 4)]:
            memory_study.enqueue_trial(point)
    # Optuna logs a failed trial (a Ctrl-C too) with its traceback at WARNING before re-raising: the error
    # itself is what the caller gets, once.
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    interrupted = False
    used = 0
    bar = _TrialBar(len(todo) if every else n_trials, multi_objective, enabled=progress)  # one bar over TPE, the local search and what is left
    try:
        if every:
            # the search's own distributions (objective_fn's suggest_* calls), so a later run's sampler reads these trials
            distributions = {
                "instance_type": optuna.distributions.CategoricalDistribution(types),
                "n_instances": optuna.distributions.IntDistribution(1, max_instances, log=True),
                "strategy": optuna.distributions.CategoricalDistribution(strategy_choices),
                "pp": optuna.distributions.IntDistribution(2, max(2, pp_hi), log=True),
                "micro_batch_size": optuna.distributions.IntDistribution(1, global_batch_size, log=True),
            }
            for number, (inst, count, plan) in enumerate(todo, start=n_before):
                trial = _priced_trial(space, inst, count, plan, distributions, bool(multi_objective))
                memory_study.add_trial(trial)
                trial.number = number  # as the study numbered it (add_trial stores a copy): the bar names it
                bar(memory_study, trial)
        elif multi_objective:
            memory_study.optimize(objective_fn, n_trials=n_trials, gc_after_trial=False, callbacks=[bar])
        else:
            # TPE first, then a local search from its best (POLISH_SHARE of the trials at most), then TPE for what is left
            reserve = int(n_trials * POLISH_SHARE) if n_trials >= 20 else 0
            memory_study.optimize(objective_fn, n_trials=n_trials - reserve, gc_after_trial=False, callbacks=[bar])
            used = _polish(memory_study, objective_fn, reserve,
                           lambda p: _neighbours(p, types, max_instances, global_batch_size, strategy_choices, pp_hi), [bar])
            if reserve - used > 0:
                memory_study.optimize(objective_fn, n_trials=reserve - used, gc_after_trial=False, callbacks=[bar])
    except KeyboardInterrupt:
        # Keep what was searched: the trials finished before the Ctrl-C are written as a finished run's are.
        interrupted = True
    finally:
        bar.close()
        optuna.logging.set_verbosity(verbosity)
    new_trials = memory_study.get_trials(deepcopy=False)[n_before:]
    if interrupted:
        new_trials = [t for t in new_trials if t.state.is_finished() and t.state != optuna.trial.TrialState.FAIL]
        if existing is None and not new_trials:
            raise KeyboardInterrupt("no trial had finished, so no study was created")

    # Write the finished run in one pass; a failure while writing a study this call created removes it
    # again (never one another run created meanwhile under the same name, nor one another run has written trials to).
    created = joined = deleted = adopted = False
    with _signals_held() as held:  # a Ctrl-C or SIGTERM now waits until the trials are written (or refused)
        try:
            target = existing
            if target is None:
                attrs = {
                    SETTINGS_ATTR: settings,
                    "objective": OBJECTIVES[False] if not multi_objective else "(C, T) per optimizer step",  # as studies made before
                    "currency": catalog.currency,
                    "catalog": {"name": catalog.name, "pricing": catalog.pricing, "source": catalog.source, "date": catalog.date,
                                "instances": [i.to_dict() for i in catalog.instances]},
                    "projections": projections,
                    "global_batch_size": global_batch_size,
                    "time_weight": float(time_weight),
                }
                whole = True  # created with its settings in one transaction, as every run of this version creates it
                try:
                    if orphan:
                        claimed = claim_study_without_attrs(store, name, minimize, attrs)
                        if claimed is None:  # claims_studies said it fits, but the database disagrees: refused as before
                            raise _unset_study_error(name, storage)
                        if not claimed:  # another run adopted it (or wrote to it) while this one searched: as one created meanwhile
                            raise optuna.exceptions.DuplicatedStudyError(name)
                        adopted = True
                    elif create_study_with_attrs(store, name, minimize, attrs):
                        created = True
                    else:
                        whole = False
                        optuna.create_study(storage=store, study_name=name, directions=directions)
                        created = True
                        # its settings in one transaction where that fits, so a run that adopts this study as a killed
                        # creator's (its OPENING_WAIT_S past) and this one never both write theirs into it
                        claimed = claim_study_without_attrs(store, name, minimize, attrs, just_created=True)
                        if claimed is False:
                            created = False  # another run's now: never deleted by this one
                            raise optuna.exceptions.DuplicatedStudyError(name)
                        whole = claimed is True  # None: its attributes through Optuna's public API, below
                    target = optuna.load_study(study_name=name, storage=store)
                except optuna.exceptions.DuplicatedStudyError:
                    # Another run (a second worker of the same command) created it while this one searched: extend it, as
                    # this run would have had it started a moment later, when it was made with the same settings.
                    target = _created_meanwhile(store, name, wait_s=0.0 if whole else CREATOR_WAIT_S)
                    theirs = _as_now(target.user_attrs.get(SETTINGS_ATTR), catalog, profile)
                    why = _settings_differ(theirs, settings)
                    if why is None:
                        repriced = _priced_otherwise(target.get_trials(deepcopy=False), catalog, space, bool(multi_objective))
                        why = None if repriced is None else f"its trials were priced by another version of the cost model ({repriced})"
                    if why is not None:
                        raise StudyConflictError(
                            f"Study {name!r} was created in {shown_url(storage)!r} by another run while this one searched, and {why}; "
                            f"it was left untouched and this run's {len(new_trials)} trials were not written.",
                            hint=f"{_NEWER_HINT} to search on, or pass another --study-name." if _newer_settings_version(theirs, settings) is not None
                            else "Pass another --study-name.",
                        ) from None
                    joined = True
            if created or adopted:
                if not whole:  # Optuna's public API: the study first, its attributes after
                    for key, value in attrs.items():
                        target.set_user_attr(key, value)
                with warnings.catch_warnings():  # experimental in Optuna; what optuna-dashboard labels the values with
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    target.set_metric_names(list(METRIC_NAMES[bool(multi_objective)]))
            write_trials(target, new_trials)
        except BaseException as err:
            if created:
                try:
                    deleted = delete_study_without_trials(store, name)  # not another run's trials
                except Exception:  # the original error matters more
                    pass
            from sqlalchemy.exc import SQLAlchemyError

            # Optuna's add_trials wraps the database's error in StorageInternalError; our one-transaction insert
            # (write_trials) re-raises SQLAlchemy's own (a full disk: OperationalError), after rolling it back.
            if isinstance(err, (optuna.exceptions.StorageInternalError, SQLAlchemyError)):
                cause = getattr(err, "orig", None) or err.__cause__ or err.__context__ or err
                raise StudyStorageError(
                    f"Writing this run's {len(new_trials)} trials to {shown_url(storage)!r} failed ({type(cause).__name__}: {first_line(cause)[:200]}); "
                    f"{'the study was not created' if deleted else 'the empty study it adopted keeps the settings of this run, without trials' if adopted else 'the study was left as it was'}.",
                    hint="Check that the database is writable and reachable, then re-run the same command.",
                ) from None
            if isinstance(err, KeyError) and not created and _existing_study_gone(store, name):
                # Optuna's "Record does not exist": the study this run extends was deleted meanwhile (optuna delete-study)
                raise StudyConflictError(
                    f"Study {name!r} was deleted from {shown_url(storage)!r} while this run searched; this run's {len(new_trials)} trials were not written.",
                    hint="Re-run the same command: it creates the study anew (or pass another --study-name).",
                ) from None
            raise
    if held and _deliver(held):
        interrupted = True
    if interrupted:
        raise KeyboardInterrupt(
            f"the {len(new_trials)} trial(s) finished before it were written to study {name!r}; re-run the same command to search on"
        )

    all_trials = _trials_as_stored(store, name, memory_study.get_trials(deepcopy=False))
    # one entry per configuration: a sampler may try one configuration in several trials
    distinct: dict[tuple[str, int, Plan], TunedConfig] = {}
    for c in (_config_from_trial(t) for t in all_trials):
        if c is not None:
            distinct.setdefault((c.instance_type, c.count, c.plan), c)
    configs = list(distinct.values())
    if not configs:
        raise _nothing_feasible(all_trials, name, global_batch_size)
    best = min(configs, key=lambda c: (c.objective, c.cost_per_step, c.step_time_s))
    return TuneResult(
        best=best,
        pareto=pareto_front(configs),
        study_name=name,
        storage=shown_url(storage),
        time_weight=float(time_weight),
        currency=catalog.currency,
        catalog=catalog.name,
        n_trials=len(new_trials),
        n_study_trials=len(all_trials),
        n_evaluations=space.evaluations,
        n_feasible=len(configs),
        space_size=space_size,
        elapsed_s=time.perf_counter() - started,
        resumed=existing is not None or joined,
        sampler=(_every_configuration(n_trials, len(todo or ())) if every
                 else type(sampler).__name__ + (f" + local search ({used} trials)" if used else "")
                 + (f" (worker {worker} of this study on this machine: seed {worker_seed(seed, worker)})" if chosen is None and worker else "")),
        projections=projections,
        pricing=catalog.pricing,
        multi_objective=bool(multi_objective),
        notes=catalog.caveats(),
    )


def exhaustive(
    profile: Profile,
    catalog: Catalog | str,
    *,
    global_batch_size: int,
    time_weight: float = 0.0,
    max_instances: int = 8,
    strategies: Sequence[str] = STRATEGIES,
    max_pp: int | None = None,
    precision: str = "auto",
    max_configurations: int = 200_000,
    pricing: str | None = None,
) -> ExhaustiveResult:
    """Price every configuration of the tuner's space: the exact optimum the search is compared with.

    ``pricing`` as :func:`tune`'s.

    Raises:
        CatalogError: unknown or malformed catalog, or spot pricing asked of one without spot prices.
        InfeasiblePlanError: the space exceeds ``max_configurations`` or nothing fits in memory.
        ModelSplitError: only pipeline strategies are requested and the profile cannot be split into stages.
    """
    started = time.perf_counter()
    if as_int(max_pp) is not None:  # a numpy integer, taken before the checks below (which refuse it for tune's study)
        max_pp = as_int(max_pp)
    _validate(profile, global_batch_size, time_weight, 1, max_instances, 0, max_pp)
    limit = as_int(max_configurations)
    if limit is None or limit < 1:
        raise InfeasiblePlanError(
            f"`max_configurations` must be an integer >= 1, got {max_configurations!r}.", hint="Pass e.g. max_configurations=200_000, or leave it out."
        )
    max_configurations = limit
    strategies = _check_strategies(strategies)
    catalog = _resolve_catalog(catalog, None, pricing)
    space = ConfigSpace(
        profile, catalog, global_batch_size=global_batch_size, time_weight=float(time_weight), max_instances=max_instances,
        strategies=strategies, max_pp=max_pp, precision=precision,
    )
    if space.size > max_configurations:
        raise InfeasiblePlanError(
            f"The space has {space.size} configurations, more than max_configurations={max_configurations}.",
            hint="Use tune() for a space this large, or raise max_configurations.",
        )
    configs = tuple(space.evaluate(inst, count, plan) for inst, count, plan in space.configurations())
    feasible = [c for c in configs if c.feasible]
    if not feasible:
        raise InfeasiblePlanError(f"None of the {len(configs)} configurations fits in memory.", hint="Allow more instances or bigger GPUs.")
    best = min(feasible, key=lambda c: (c.objective, c.cost_per_step, c.step_time_s))
    return ExhaustiveResult(
        best=best,
        pareto=pareto_front(feasible),
        n_evaluations=space.evaluations,
        n_feasible=len(feasible),
        elapsed_s=time.perf_counter() - started,
        configs=configs,
    )
