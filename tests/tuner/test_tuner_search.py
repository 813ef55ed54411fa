"""The Optuna search over the cost model: valid configurations, stored trials, errors before any trial."""

from __future__ import annotations

import contextlib
import math
import os
import re
import sqlite3
from pathlib import Path

import optuna
import pytest
from tuner_profile_factory import make_profile

from lightning_distplan.errors import CatalogError, InfeasiblePlanError, ModelSplitError
from lightning_distplan.planner import enumerate_plans
from lightning_distplan.profile import Profile
from lightning_distplan.tuner import (
    ConfigSpace,
    StudyConflictError,
    StudyStorageError,
    exhaustive,
    load_catalog,
    pareto_front,
    tune,
)

B = 64


@pytest.fixture(scope="module")
def profile():
    return make_profile()


def _url(tmp_path, name="study.db"):
    return f"sqlite:///{tmp_path / name}"


def _spawn(tmp_path, code: str, *args: str):
    """A child Python running ``code`` with ``args``, stdin and stdout piped for a handshake, its stderr into a file of
    ``tmp_path`` that :func:`_line_of` shows where the child fails (a pipe that nobody reads could fill and hold it)."""
    import subprocess
    import sys

    err = tmp_path / f"child-{len(list(tmp_path.glob('child-*.err')))}.err"
    with open(err, "w") as f:
        child = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f, text=True)
    child.err_path = err
    return child


def _line_of(child, timeout: float = 120.0) -> str:
    """The next line ``child`` (:func:`_spawn`) writes to its stdout, stripped. A child that exits first, or writes none
    within ``timeout`` s (it is killed then), fails the test at once with its stderr: the bare readline waited for
    pytest's own 600 s timeout, and showed nothing of why."""
    import threading

    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(child.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if got and got[0]:
        return got[0].strip()
    when = f"in {timeout:g} s" if not got else "before it exited"  # read before the kill ends the readline
    if child.poll() is None:
        child.kill()
    child.wait()
    pytest.fail(f"the child wrote no line {when} (exit code {child.returncode}); its stderr:\n{child.err_path.read_text()}", pytrace=False)


def _reap(children: list) -> None:
    """End the child processes a test started that are still running (a failed assertion left them), and close their pipes."""
    for child in children:
        if child.poll() is None:
            child.kill()
            child.wait()
        with contextlib.suppress(BrokenPipeError):  # a line written but not flushed to a child that is gone (as Popen.communicate)
            child.stdin.close()
        child.stdout.close()


def test_reap_closes_both_pipes_of_a_child_a_failed_test_left_running(tmp_path):
    """_reap closed a child's stdout but not its stdin: a test that failed before writing its "go" left the pipe's
    descriptor open until the garbage collector found it (a ResourceWarning, one descriptor per child)."""
    child = _spawn(tmp_path, "import sys; sys.stdin.readline()")
    child.stdin.write("never flushed")  # buffered: closing it flushes into a pipe whose reader is gone
    _reap([child])
    assert child.returncode is not None and child.stdin.closed and child.stdout.closed


def test_tune_stores_every_trial_with_its_breakdown_and_every_config_factors_the_batch(tmp_path, profile):
    url = _url(tmp_path)
    result = tune(profile, catalog="alicloud-2023", global_batch_size=B, time_weight=4096, n_trials=40, storage=url,
                  study_name="s", max_instances=4, progress=False)
    study = optuna.load_study(study_name="s", storage=url)
    assert len(study.trials) == 40 == result.n_trials == result.n_study_trials
    assert study.user_attrs["distplan_settings"]["global_batch_size"] == B and study.user_attrs["currency"] == "RMB"
    for t in study.trials:
        a = t.user_attrs
        if "plan" not in a:  # a strategy with no plan on that many devices
            assert t.state == optuna.trial.TrialState.PRUNED and a["feasible"] is False
            assert a["reason"].startswith("no ") or (a["reason"].startswith("a pipeline needs at least 2 devices") and a["world_size"] == 1)
            continue
        plan = a["plan"]
        # DESIGN §3.1: B = dp·m·s (dp_ga) or dp·m·n (pipelines)
        assert plan["dp"] * plan["micro_batch_size"] * plan["accumulate_grad_batches"] * plan["n_microbatches"] == B
        assert a["world_size"] == plan["dp"] * plan["pp"]
        for key in ("breakdown", "memory", "price_per_hour", "currency", "projection", "feasible", "step_time_s", "cost_per_step"):
            assert key in a, key
        if a["feasible"]:
            assert t.state == optuna.trial.TrialState.COMPLETE
            assert t.value == pytest.approx(a["cost_per_step"] + 4096 * a["step_time_s"])
            assert sum(a["breakdown"].values()) == pytest.approx(a["step_time_s"])
            # C = instances · price/3600 · T (seed 000 §IV-D)
            assert a["cost_per_step"] == pytest.approx(a["count"] * a["price_per_hour"] / 3600 * a["step_time_s"])
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert result.best.objective == pytest.approx(min(t.value for t in complete))
    assert study.best_value == pytest.approx(result.best.objective)
    # the Pareto front: sorted by cost, strictly faster as it gets dearer, nothing feasible dominates a point
    front = result.pareto
    assert [c.cost_per_step for c in front] == sorted(c.cost_per_step for c in front)
    assert all(a.step_time_s > b.step_time_s for a, b in zip(front, front[1:]))
    for t in complete:
        c, s = t.user_attrs["cost_per_step"], t.user_attrs["step_time_s"]
        assert not any(c < p.cost_per_step and s < p.step_time_s for p in front)
    out = result.to_dict()
    for key in ("instance_type", "count", "strategy", "schedule", "micro_batch_size", "accumulation", "dp", "pp",
                "predicted_step_time_s", "predicted_cost_per_step", "currency"):
        assert key in out["best"]


def test_infeasible_configurations_are_pruned_with_the_reason(tmp_path):
    # 24 layers of 300 MB: 7.2 GB of parameters, 4x that with grads and Adam -> no single T4/A10 slice holds it
    big = make_profile(n_layers=24, param_bytes_per_layer=300_000_000)
    result = tune(big, catalog="alicloud-2023", global_batch_size=B, n_trials=30, storage=_url(tmp_path), study_name="big",
                  max_instances=4, progress=False)
    study = optuna.load_study(study_name="big", storage=_url(tmp_path))
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned and all(t.user_attrs["feasible"] is False and t.user_attrs["reason"] for t in pruned)
    assert any("exceeds" in t.user_attrs["reason"] for t in pruned)
    assert result.best.feasible and result.best.peak_memory_bytes <= 0.9 * result.best.device_memory_bytes


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("distplan.db", r"Storage 'distplan.db' is not a database URL.*HINT"),
        # SQLite said only "unable to open database file"
        ("sqlite:////nonexistent-dir/x/study.db",
         r"The folder '/nonexistent-dir/x' of the storage URL 'sqlite:////nonexistent-dir/x/study.db' does not exist; SQLite creates the "
         r"database file, not its folder\. HINT: Create the folder first"),
        ("sqlite:///~/study.db", r"The folder '~' of .* does not exist \(a ~ in a storage URL is not your home folder; write the path out\).*HINT: Write the path out, e.g. sqlite:////"),
        ("nosuchdialect://host/db", r"Cannot open the study storage 'nosuchdialect://host/db'.*HINT"),
        ("sqlite://", r"in-memory SQLite database, which vanishes with this process.*HINT: Name a file"),
        ("sqlite:///:memory:", r"in-memory SQLite database.*HINT"),
        ("sqlite+pysqlite://", r"in-memory SQLite database.*HINT"),
        ("sqlite://distplan.db", r"names 'distplan.db' as a server.*HINT: Use sqlite:///distplan.db"),
    ],
)
def test_bad_storage_fails_before_any_trial(profile, url, match, monkeypatch):
    calls = []
    monkeypatch.setattr(ConfigSpace, "evaluate", lambda *a, **k: calls.append(a))
    with pytest.raises(StudyStorageError, match=match):
        tune(profile, catalog="alicloud-2023", global_batch_size=B, n_trials=5, storage=url, study_name="x", max_instances=2, progress=False)
    assert calls == []


def test_unknown_catalog_lists_names(profile, tmp_path):
    with pytest.raises(CatalogError, match="alicloud-2023, aws-2026"):
        tune(profile, catalog="azure", global_batch_size=B, n_trials=5, storage=_url(tmp_path), progress=False)


def _snapshot(db):
    con = sqlite3.connect(db)
    try:
        return {t: con.execute(f"select * from {t}").fetchall() for t in ("trials", "trial_params", "trial_values", "trial_user_attributes", "study_user_attributes")}
    finally:
        con.close()


def test_existing_study_with_other_settings_is_left_untouched(tmp_path, profile, monkeypatch):
    import time

    from lightning_distplan.tuner import search

    url = _url(tmp_path)
    tune(profile, catalog="alicloud-2023", global_batch_size=B, time_weight=0, n_trials=15, storage=url, study_name="s", max_instances=2, progress=False)
    before = _snapshot(tmp_path / "study.db")
    with pytest.raises(StudyConflictError, match=r"Study 's' already exists.*time_weight 0.0 -> 4096.0.*left untouched.*HINT"):
        tune(profile, catalog="alicloud-2023", global_batch_size=B, time_weight=4096, n_trials=15, storage=url, study_name="s", max_instances=2, progress=False)
    assert _snapshot(tmp_path / "study.db") == before  # not one row added or changed
    # a study someone else made under that name is refused too
    optuna.create_study(study_name="foreign", storage=url).optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    before_foreign = _snapshot(tmp_path / "study.db")
    monkeypatch.setattr(search, "OPENING_WAIT_S", 30.0)
    started = time.monotonic()
    with pytest.raises(StudyConflictError, match="not created by `distplan tune`"):
        tune(profile, catalog="alicloud-2023", global_batch_size=B, n_trials=5, storage=url, study_name="foreign", max_instances=2, progress=False)
    assert time.monotonic() - started < 10  # its trials say it is someone else's: not waited for as one being created
    assert _snapshot(tmp_path / "study.db") == before_foreign
    # one with neither attributes nor trials: where this Optuna creates studies whole (it does here), no worker's study is
    # ever so, and it is refused at once as someone else's (it was refused after OPENING_WAIT_S, as one being created)
    # (a system attribute of another program's: without one, a study waited for in vain is adopted instead, see
    # test_an_empty_study_a_creator_killed_before_its_settings_left_is_adopted_by_a_re_run)
    empty = optuna.create_study(study_name="empty", storage=url)
    empty._storage.set_study_system_attr(empty._study_id, "owner", "another program")
    before_empty = _snapshot(tmp_path / "study.db")
    started = time.monotonic()
    with pytest.raises(StudyConflictError, match=r"^Study 'empty' already exists in .* and it was not created by `distplan tune`; it was left untouched"):
        tune(profile, catalog="alicloud-2023", global_batch_size=B, n_trials=5, storage=url, study_name="empty", max_instances=2, progress=False)
    assert time.monotonic() - started < 10
    assert _snapshot(tmp_path / "study.db") == before_empty
    # where studies are made through Optuna's public API, it may be another run's, between its create_study and its
    # set_user_attr: waited for (test_a_run_waits_for_the_settings_of_a_study_another_run_is_creating_through_optunas_api), then refused
    monkeypatch.setattr(search, "creates_studies_whole", lambda store: False)
    monkeypatch.setattr(search, "OPENING_WAIT_S", 0.5)
    started = time.monotonic()
    with pytest.raises(StudyConflictError, match=r"^Study 'empty' already exists in .* with neither distplan's settings nor trials, and no run "
                                                 r"creating it stored its settings in the 0\.5 s this run waited; it was left untouched\. HINT: "
                                                 r"If another `distplan tune` is creating it, re-run the same command; else pass a new "
                                                 r"--study-name, or delete the empty study \(`optuna delete-study --study-name=empty .*\)\.$"):
        tune(profile, catalog="alicloud-2023", global_batch_size=B, n_trials=5, storage=url, study_name="empty", max_instances=2, progress=False)
    assert time.monotonic() - started >= 0.5
    assert _snapshot(tmp_path / "study.db") == before_empty
    s = optuna.load_study(study_name="s", storage=url)
    assert len(s.trials) == 15 and s.user_attrs["time_weight"] == 0.0


_KILLED_CREATOR_REFUSALS = {
    # study -> how the run refuses it, after the fix as before it
    "with_trial": "not created by `distplan tune`; it was left untouched. HINT: Pass a new --study-name, or delete the old study",
    "with_attrs": "not created by `distplan tune`; it was left untouched. HINT: Pass a new --study-name, or delete the old study",
    "with_system_attr": "with neither distplan's settings nor trials, and no run creating it stored its settings in the 0.3 s this run waited",
    "maximize": "with neither distplan's settings nor trials, and no run creating it stored its settings in the 0.3 s this run waited",
    # made empty by hand under a name the user chose (perhaps for a search of their own): the same bytes as a killed
    # creator's study, but never filled with this search's trials; only the default name is distplan's own
    "mine": "with neither distplan's settings nor trials, and no run creating it stored its settings in the 0.3 s this run waited",
}


def test_an_empty_study_a_creator_killed_before_its_settings_left_is_adopted_by_a_re_run(tmp_path, profile, monkeypatch):
    """Where studies are created through Optuna's public API (an Optuna whose models do not fit create_study_with_attrs),
    a creator killed between its ``optuna.create_study`` and its ``set_user_attr`` leaves a study with neither settings
    nor trials, and every re-run waited OPENING_WAIT_S for it and refused it. Nothing is in it: a re-run adopts it
    (writes its settings into it) and searches on, under distplan's default name. A study with a trial, attributes of its
    own, a system attribute or other directions is someone else's, and so may be an empty one under a name the user
    passed (made by hand for another search): still refused with the same message, the file not changed by one byte."""
    from lightning_distplan.tuner import search

    url = _url(tmp_path)
    db = tmp_path / "study.db"
    monkeypatch.setattr(search, "create_study_with_attrs", lambda *a, **k: False)  # the public API, as that Optuna makes studies
    monkeypatch.setattr(search, "creates_studies_whole", lambda store: False)
    monkeypatch.setattr(search, "OPENING_WAIT_S", 0.3)
    kw = dict(catalog="alicloud-2023", global_batch_size=B, storage=url, max_instances=2, progress=False)
    default = f"distplan-alicloud-2023-B{B}-w0"  # the study name a run without --study-name uses
    optuna.create_study(storage=url, study_name=default, directions=["minimize"])  # the killed creator's study, as it left it
    optuna.create_study(storage=url, study_name="mine")  # the user's own, made by hand and not used yet
    optuna.create_study(storage=url, study_name="with_trial").enqueue_trial({"x": 1.0})  # a waiting trial, no attributes
    optuna.create_study(storage=url, study_name="with_attrs").set_user_attr("owner", "someone")
    foreign = optuna.create_study(storage=url, study_name="with_system_attr")
    foreign._storage.set_study_system_attr(foreign._study_id, "owner", "another program")
    optuna.create_study(storage=url, study_name="maximize", direction="maximize")
    for name, why in _KILLED_CREATOR_REFUSALS.items():
        before = db.read_bytes()
        with pytest.raises(StudyConflictError) as refused:
            tune(profile, n_trials=4, study_name=name, **kw)
        assert str(refused.value).startswith(f"Study {name!r} already exists in {url!r} ") and why in str(refused.value), str(refused.value)
        assert db.read_bytes() == before, name

    result = tune(profile, n_trials=5, **kw)
    study = optuna.load_study(study_name=default, storage=url)
    assert result.n_trials == result.n_study_trials == len(study.trials) == 5 and not result.resumed
    assert study.user_attrs["distplan_settings"]["global_batch_size"] == B and study.user_attrs["currency"] == "RMB"
    assert study.metric_names == ["cost_per_step + w*step_time_s"]  # set as on a study it creates
    assert optuna.get_all_study_names(url).count(default) == 1
    assert tune(profile, n_trials=3, **kw).n_study_trials == 8  # and extended as any other


def test_an_empty_study_is_claimed_once_and_a_study_with_anything_in_it_never(tmp_path):
    """The adoption's write (claim_study_without_attrs) checks the study is still empty in its own transaction: of two
    runs adopting one study, the second finds it claimed and writes nothing; a study with a trial or other directions is
    never written to."""
    from lightning_distplan.tuner._storage import claim_study_without_attrs, open_storage

    url = _url(tmp_path)
    store = open_storage(url)
    minimize = [optuna.study.StudyDirection.MINIMIZE]
    optuna.create_study(storage=url, study_name="s")
    assert claim_study_without_attrs(store, "s", minimize, {"who": "first"}) is True
    assert claim_study_without_attrs(store, "s", minimize, {"who": "second"}) is False
    assert optuna.load_study(study_name="s", storage=url).user_attrs == {"who": "first"}
    optuna.create_study(storage=url, study_name="t").enqueue_trial({"x": 1.0})
    optuna.create_study(storage=url, study_name="u", direction="maximize")
    before = (tmp_path / "study.db").read_bytes()
    assert claim_study_without_attrs(store, "t", minimize, {"who": "first"}) is False
    assert claim_study_without_attrs(store, "u", minimize, {"who": "first"}) is False
    assert claim_study_without_attrs(store, "gone", minimize, {"who": "first"}) is False
    assert (tmp_path / "study.db").read_bytes() == before


@pytest.mark.parametrize("write", ["claim", "delete"])
def test_a_study_replaced_under_its_id_between_the_read_and_the_lock_is_left_alone(tmp_path, write):
    """On SQLite the study's read takes no lock: another run may delete the study and create one that reuses its id before
    the claim's (or the delete's) locking UPDATE. Locked by id alone, the claim wrote this search's settings into that
    other study and the delete removed it; the UPDATE now names the study too, and nothing is written."""
    import sqlalchemy

    from lightning_distplan.tuner._storage import claim_study_without_attrs, delete_study_without_trials, open_storage

    url = _url(tmp_path)
    store = open_storage(url)
    optuna.create_study(storage=url, study_name="s")
    engine = getattr(store, "_backend", store).engine
    replaced = []

    def replace_it(conn, cursor, statement, *args):  # another run, between the read and the lock
        if statement.lstrip().upper().startswith("UPDATE STUDIES") and not replaced:
            with sqlite3.connect(tmp_path / "study.db") as other:
                (study_id,) = other.execute("SELECT study_id FROM studies WHERE study_name = 's'").fetchone()
                other.execute("DELETE FROM study_directions WHERE study_id = ?", (study_id,))
                other.execute("DELETE FROM studies WHERE study_id = ?", (study_id,))
                other.execute("INSERT INTO studies (study_id, study_name) VALUES (?, 'theirs')", (study_id,))
                other.execute("INSERT INTO study_directions (direction, study_id, objective) VALUES ('MINIMIZE', ?, 0)",
                              (study_id,))
            replaced.append(study_id)

    sqlalchemy.event.listen(engine, "before_cursor_execute", replace_it)
    if write == "claim":
        assert claim_study_without_attrs(store, "s", [optuna.study.StudyDirection.MINIMIZE], {"who": "us"}) is False
    else:
        assert delete_study_without_trials(store, "s") is False
    sqlalchemy.event.remove(engine, "before_cursor_execute", replace_it)
    assert replaced
    assert optuna.get_all_study_names(url) == ["theirs"]
    assert optuna.load_study(study_name="theirs", storage=url).user_attrs == {}


def test_the_claim_is_not_offered_where_this_optunas_direction_model_does_not_fit_it(tmp_path, monkeypatch):
    """An Optuna whose StudyModel / StudyDirectionModel changed is the one whose studies are created through the public API
    (creates_studies_whole False), and the claim reads those very models: claims_studies said yes without looking at
    them, so a run adopted an empty study, searched, and was refused only at the write, its search lost."""
    from optuna.storages._rdb import models

    from lightning_distplan.tuner._storage import claims_studies, creates_studies_whole, open_storage

    store = open_storage(_url(tmp_path))
    assert claims_studies(store) and creates_studies_whole(store)

    class Changed:  # direction rows of another shape
        def __init__(self, **kwargs):
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")

    monkeypatch.setattr(models, "StudyDirectionModel", Changed)
    assert not creates_studies_whole(store)
    assert not claims_studies(store)


@pytest.mark.parametrize("multi_objective", [False, True])
def test_a_study_priced_by_another_cost_model_is_not_extended(tmp_path, profile, multi_objective):
    """Same settings, but the stored values are not what this version's model gives (as a study made before a fix of the
    model has): extending it would mix two models and keep the old best. Refused, the file untouched."""
    url = _url(tmp_path)
    kw = dict(catalog="alicloud-2023", global_batch_size=B, n_trials=15, storage=url, study_name="s", max_instances=2,
              progress=False, multi_objective=multi_objective)
    tune(profile, **kw)
    con = sqlite3.connect(tmp_path / "study.db")
    con.execute("update trial_values set value = value / 4.5")  # an older model's (faster, cheaper) predictions
    con.commit()
    con.close()
    before = _snapshot(tmp_path / "study.db")
    with pytest.raises(StudyConflictError, match=r"with these settings, but its trials were priced by another version of the cost model "
                       r"\(trial \d+ \(.*\) is stored as .* but this version prices it .*\); it was left untouched.*HINT: Pass a new --study-name"):
        tune(profile, **kw)
    assert _snapshot(tmp_path / "study.db") == before


def test_failed_run_writes_nothing(tmp_path, profile, monkeypatch):
    url = _url(tmp_path)

    def boom(*a, **k):
        raise RuntimeError("cost model exploded")

    monkeypatch.setattr(ConfigSpace, "evaluate", boom)
    with pytest.raises(RuntimeError, match="exploded"):
        tune(profile, catalog="alicloud-2023", global_batch_size=B, n_trials=5, storage=url, study_name="s", max_instances=2, progress=False)
    assert optuna.get_all_study_names(url) == []


def _other_run_finishes_first(profile, **kw):
    class OtherRunFinishesFirst(optuna.samplers.RandomSampler):
        def before_trial(self, study, trial):  # while this run searches, another one with the same name writes its study
            if trial.number == 0:
                tune(profile, n_trials=6, **kw)
            super().before_trial(study, trial)

    return OtherRunFinishesFirst(seed=0)


def test_a_new_study_another_run_created_meanwhile_with_the_same_settings_gets_this_runs_trials(tmp_path, profile):
    """Two workers of one command on a new study (reproduced with two `distplan tune` processes started together): the
    one that wrote second was refused with "Re-run the same command" and its trials (200 there) were thrown away,
    though its study was the very one it would have extended had it started a moment later."""
    url = _url(tmp_path)
    kw = dict(catalog="alicloud-2023", global_batch_size=B, storage=url, study_name="s", max_instances=2, progress=False)
    result = tune(profile, n_trials=5, sampler=_other_run_finishes_first(profile, **kw), **kw)
    stored = optuna.load_study(study_name="s", storage=url).trials
    assert len(stored) == 11 and sorted(t.number for t in stored) == list(range(11))
    assert result.n_trials == 5 and result.n_study_trials == 11 and result.resumed
    assert tune(profile, n_trials=3, **kw).n_study_trials == 14  # one study, extended as any other


def test_a_study_another_run_created_meanwhile_with_other_settings_is_never_deleted(tmp_path, profile):
    """Two tunes of one new study name with other settings: the one that writes second is refused and leaves the first's study whole."""
    url = _url(tmp_path)
    kw = dict(catalog="alicloud-2023", global_batch_size=B, storage=url, study_name="s", max_instances=2, progress=False)
    sampler = _other_run_finishes_first(profile, **{**kw, "max_instances": 3})
    with pytest.raises(StudyConflictError, match=r"Study 's' was created in .* by another run while this one searched, and settings differ: "
                                                 r"max_instances 3 -> 2; it was left untouched and this run's 5 trials were not written.*HINT: Pass another"):
        tune(profile, n_trials=5, sampler=sampler, **kw)
    assert len(optuna.load_study(study_name="s", storage=url).trials) == 6


def test_a_study_of_that_name_someone_else_created_meanwhile_is_refused_at_once(tmp_path, profile):
    """`optuna create-study --study-name s` while a `distplan tune --study-name s` searched: the run waited 30 s for the
    study's distplan settings before refusing it (reproduced: refused 30.0 s after its search ended). A run creates its
    study with its settings in one transaction now, so a study without them is someone else's."""
    import time

    url = _url(tmp_path)
    kw = dict(catalog="alicloud-2023", global_batch_size=B, storage=url, study_name="s", max_instances=2, progress=False)

    class SomeoneElse(optuna.samplers.RandomSampler):
        def before_trial(self, study, trial):
            if trial.number == 0:
                optuna.create_study(study_name="s", storage=url)
            super().before_trial(study, trial)

    started = time.monotonic()
    with pytest.raises(StudyConflictError, match=r"^Study 's' was created in .* by another run while this one searched, and it was not created by "
                                                 r"`distplan tune`; it was left untouched and this run's 3 trials were not written\. HINT: Pass another --study-name\.$"):
        tune(profile, n_trials=3, sampler=SomeoneElse(seed=0), **kw)
    assert time.monotonic() - started < 10
    foreign = optuna.load_study(study_name="s", storage=url)
    assert foreign.trials == [] and foreign.user_attrs == {}  # left as its owner made it


def test_a_study_is_created_through_optunas_api_where_its_models_do_not_fit(tmp_path, profile, monkeypatch, caplog):
    """Where this Optuna's models do not fit create_study_with_attrs (here: its user attribute model refuses the
    arguments), the half-made study row is rolled back and the run creates the study through Optuna's public API: a
    study left behind would make that create fail as a duplicate of the run's own, and the run would refuse it."""
    import logging

    from optuna.storages._rdb import models

    from lightning_distplan.tuner._storage import create_study_with_attrs, creates_studies_whole, open_storage

    url = _url(tmp_path)
    store = open_storage(url)

    class Refused(models.StudyUserAttributeModel):
        def __init__(self, **kwargs):
            raise TypeError("a model of another Optuna")

    with monkeypatch.context() as patch:
        patch.setattr(models, "StudyUserAttributeModel", Refused)
        with caplog.at_level(logging.INFO, logger="lightning_distplan.tuner._storage"):
            assert create_study_with_attrs(store, "s", [optuna.study.StudyDirection.MINIMIZE], {"a": 1}) is False
        assert creates_studies_whole(store) is False  # what a run finding a study without settings asks: it waits for them
    assert creates_studies_whole(store) is True  # this Optuna's models fit
    assert "Creating a study in one transaction is unavailable (TypeError: a model of another Optuna)" in caplog.text
    assert optuna.get_all_study_names(url) == []  # nothing written: the study row went with the transaction
    kw = dict(catalog="alicloud-2023", global_batch_size=B, storage=url, study_name="s", max_instances=2, progress=False)
    monkeypatch.setattr("lightning_distplan.tuner.search.create_study_with_attrs", lambda *a, **k: False)
    result = tune(profile, n_trials=5, **kw)
    study = optuna.load_study(study_name="s", storage=url)
    assert result.n_study_trials == len(study.trials) == 5 and not result.resumed
    assert study.user_attrs["distplan_settings"]["global_batch_size"] == B and study.user_attrs["currency"] == "RMB"
    assert tune(profile, n_trials=3, **kw).n_study_trials == 8  # and extended as any other


_CREATOR_PAUSED = """
import sys
import _distplan_cli
_distplan_cli.starting = True  # as `distplan tune` imports the package: neither torch nor Lightning (~10 s of CPU)
sys.path.insert(0, sys.argv[2])
import optuna
from tuner_profile_factory import make_profile
from lightning_distplan.tuner import search
search.create_study_with_attrs = lambda *a, **k: False  # an Optuna whose models do not fit: the public API
search.claim_study_without_attrs = lambda *a, **k: None  # ...nor its one-transaction claim: set_user_attr after the create
set_user_attr = optuna.study.Study.set_user_attr
def paused(self, key, value):  # the study is created, none of its attributes set yet
    if not self.user_attrs:
        print("created", flush=True)
        sys.stdin.readline()  # "go"
    set_user_attr(self, key, value)
optuna.study.Study.set_user_attr = paused
r = search.tune(make_profile(), catalog="alicloud-2023", global_batch_size=64, storage=sys.argv[1], study_name="s", max_instances=2,
                n_trials=6, progress=False)
print(r.n_trials, flush=True)
"""


_OPENER = """
import sys
import _distplan_cli
_distplan_cli.starting = True  # as `distplan tune` imports the package: neither torch nor Lightning (~10 s of CPU)
sys.path.insert(0, sys.argv[2])
from tuner_profile_factory import make_profile
from lightning_distplan.tuner import search
search.OPENING_WAIT_S = 120.0  # the wait is the subject, not its length: the test's timing does not depend on the load
search.creates_studies_whole = lambda store: False  # the creator's Optuna, whose models do not fit: the public API
search.claims_studies = lambda store: False  # ...nor the claim: a study that stays without settings is refused, not adopted
created_meanwhile = search._created_meanwhile
def waiting(*args, **kwargs):  # it found the study without settings or trials, and waits for them
    print("waiting", flush=True)
    return created_meanwhile(*args, **kwargs)
search._created_meanwhile = waiting
print("ready", flush=True)
sys.stdin.readline()  # "open": the study is created, without its attributes yet
r = search.tune(make_profile(), catalog="alicloud-2023", global_batch_size=64, storage=sys.argv[1], study_name="s", max_instances=2,
                n_trials=4, progress=False)
print(r.resumed, r.n_trials, flush=True)
"""


def test_a_run_waits_for_the_settings_of_a_study_another_run_is_creating_through_optunas_api(tmp_path, profile, monkeypatch):
    """Where studies are created through Optuna's public API (create_study_with_attrs does not fit this Optuna), a
    study is created first and given its settings after. A run that finds its new study's name taken by another
    worker of the same command caught in between (here: a `tune` in another process, held there) waits for the
    settings (CREATOR_WAIT_S) and then extends that study with its trials, as it would have had it started later.
    A run that starts in between (a third process) and finds the study without attributes or trials waited for
    nothing and refused it as not distplan's: it waits for the settings too (OPENING_WAIT_S), then extends it."""
    import threading
    import time

    from lightning_distplan.tuner import search

    url = _url(tmp_path)
    kw = dict(catalog="alicloud-2023", global_batch_size=B, storage=url, study_name="s", max_instances=2, progress=False)
    monkeypatch.setattr(search, "create_study_with_attrs", lambda *a, **k: False)
    children: list = []
    waited: list[float] = []

    class OtherRunCreatesMeanwhile(optuna.samplers.RandomSampler):
        def before_trial(self, study, trial):
            if trial.number == 0:  # this run has found no study "s"; the other one creates it now
                child = _spawn(tmp_path, _CREATOR_PAUSED, url, str(Path(__file__).parent))
                opener = _spawn(tmp_path, _OPENER, url, str(Path(__file__).parent))
                children.extend([child, opener])
                assert _line_of(child) == "created"
                assert optuna.load_study(study_name="s", storage=url).user_attrs == {}
                assert _line_of(opener) == "ready"
                opener.stdin.write("open\n")  # it finds the study as it is now: no attributes, no trials
                opener.stdin.close()
                assert _line_of(opener) == "waiting"

                def go() -> None:  # released once this run has waited a while for the settings
                    time.sleep(2.0)
                    waited.append(time.monotonic())
                    child.stdin.write("go\n")
                    child.stdin.close()

                threading.Thread(target=go, daemon=True).start()
            super().before_trial(study, trial)

    try:
        result = tune(profile, n_trials=5, sampler=OtherRunCreatesMeanwhile(seed=0), **kw)
        joined = time.monotonic()
        assert [c.wait(timeout=240) for c in children] == [0, 0], [c.err_path.read_text()[-2000:] for c in children]
        assert children[0].stdout.read().strip() == "6"
        assert children[1].stdout.read().strip() == "True 4"  # the opener extended the study it had waited for
    finally:
        _reap(children)
    assert waited and joined >= waited[0]  # it waited for the other run's settings, not refused the study at once
    assert result.resumed and result.n_trials == 5
    study = optuna.load_study(study_name="s", storage=url)
    assert sorted(t.number for t in study.trials) == list(range(15))
    assert study.user_attrs["distplan_settings"]["max_instances"] == 2 and study.user_attrs["currency"] == "RMB"
    assert tune(profile, n_trials=3, **kw).n_study_trials == 18  # one study, extended as any other


def test_a_failed_run_never_deletes_trials_another_run_wrote_to_the_study_it_created(tmp_path, profile, monkeypatch):
    """A run whose write fails deletes the study it created when the study holds no trial. Checked, then deleted
    (get_all_trials, then optuna.delete_study), the trials another run extending the study committed in between went
    with it while that run reported them written; and on SQLite a run whose study was deleted just before its insert
    wrote its trials into no study, reporting success. Here the other run writes right after the check."""
    import threading

    import sqlalchemy
    from sqlalchemy import event

    import lightning_distplan.tuner.search as search

    url = _url(tmp_path)
    kw = dict(catalog="alicloud-2023", global_batch_size=B, storage=url, study_name="s", max_instances=2, progress=False)
    main, real_write = threading.get_ident(), search.write_trials
    failed, other_writes, other_done = threading.Event(), threading.Event(), threading.Event()
    other: dict = {}

    def write(study, trials):
        if threading.get_ident() == main:  # the creator's write fails (a full disk)
            failed.set()
            raise sqlalchemy.exc.OperationalError("INSERT INTO trials ...", {}, sqlite3.OperationalError("database or disk is full"))
        other_writes.set()
        real_write(study, trials)

    def other_run():
        try:
            other["result"] = tune(profile, n_trials=5, seed=1, **kw)
        except BaseException as err:  # noqa: BLE001 - examined below
            other["error"] = err
        finally:
            other_done.set()

    def after_statement(conn, cursor, statement, parameters, context, executemany):
        if failed.is_set() and threading.get_ident() == main and "FROM trials" in statement and "thread" not in other:
            # the failed run has looked for trials in its study: another run extends the study and writes now
            other["thread"] = threading.Thread(target=other_run, daemon=True)
            other["thread"].start()
            assert other_writes.wait(120), other
            other_done.wait(5)  # it lands, or waits for this transaction (the fix)

    monkeypatch.setattr(search, "write_trials", write)
    event.listen(sqlalchemy.engine.Engine, "after_cursor_execute", after_statement)
    try:
        with pytest.raises(StudyStorageError, match=r"database or disk is full"):
            tune(profile, n_trials=5, **kw)
    finally:
        event.remove(sqlalchemy.engine.Engine, "after_cursor_execute", after_statement)
    assert "thread" in other
    other["thread"].join(120)
    con = sqlite3.connect(tmp_path / "study.db")
    orphans = con.execute("select count(*) from trials where study_id not in (select study_id from studies)").fetchone()[0]
    con.close()
    assert orphans == 0
    if "result" in other:  # the other run says its trials are written: they are, in the study
        assert optuna.get_all_study_names(url) == ["s"]
        assert len(optuna.load_study(study_name="s", storage=url).trials) == other["result"].n_study_trials == 5
    else:  # the study went before they were: the other run says so
        assert isinstance(other["error"], StudyConflictError) and "was deleted from" in str(other["error"]), other
        assert optuna.get_all_study_names(url) == []


@pytest.mark.parametrize("strategies", [("1f1b",), ("gpipe", "1f1b")])
def test_pipeline_only_search_starts_from_pipeline_corners(tmp_path, profile, strategies):
    result = tune(profile, catalog="alicloud-2023", global_batch_size=B, n_trials=12, storage=_url(tmp_path), study_name="p",
                  max_instances=4, strategies=strategies, progress=False)
    trials = optuna.load_study(study_name="p", storage=_url(tmp_path)).trials
    assert trials[0].params["strategy"] == strategies[0] and trials[0].params["pp"] == 2  # the initial design, in the searched strategies
    assert {t.params["strategy"] for t in trials} <= set(strategies) and result.best.plan.strategy in strategies


def test_read_only_storage_is_refused_before_the_search(tmp_path, profile):
    url = _url(tmp_path)
    tune(profile, catalog="alicloud-2023", global_batch_size=B, n_trials=4, storage=url, study_name="s", max_instances=2, progress=False)
    before = _snapshot(tmp_path / "study.db")
    read_only = f"sqlite:///file:{tmp_path / 'study.db'}?mode=ro&uri=true"
    with pytest.raises(StudyStorageError, match=r"opens the database read-only, and a search writes its trials.*HINT"):
        tune(profile, catalog="alicloud-2023", global_batch_size=B, n_trials=4, storage=read_only, study_name="s", max_instances=2, progress=False)
    assert _snapshot(tmp_path / "study.db") == before


def test_a_failed_write_is_one_storage_error_naming_the_cause(tmp_path, profile, monkeypatch):
    """What a database that refuses writes mid-run gives (root ignores file modes, so the failure is injected)."""
    import lightning_distplan.tuner.search as search

    def refuse(study, trials):
        try:
            raise sqlite3.OperationalError("attempt to write a readonly database")
        except sqlite3.OperationalError as err:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from err

    monkeypatch.setattr(search, "write_trials", refuse)
    with pytest.raises(StudyStorageError, match=r"Writing this run's 4 trials to .* failed \(OperationalError: attempt to write a readonly database\); the study was not created.*HINT"):
        tune(profile, catalog="alicloud-2023", global_batch_size=B, n_trials=4, storage=_url(tmp_path), study_name="s", max_instances=2, progress=False)
    assert optuna.get_all_study_names(_url(tmp_path)) == []


@pytest.mark.parametrize("existing", [False, True])
def test_a_write_the_database_refuses_is_one_storage_error_and_no_trial_is_kept(tmp_path, profile, monkeypatch, existing):
    """The one-transaction insert (write_trials) re-raises SQLAlchemy's own error when the database refuses it (a full
    disk: "database or disk is full"), not Optuna's StorageInternalError. tune() mapped only the latter, so a full disk
    while extending a study, or creating one, ended `distplan tune` in SQLAlchemy's traceback (exit status 1)."""
    import sqlalchemy.exc

    import lightning_distplan.tuner._storage as storage_module

    url = _url(tmp_path)
    kw = dict(catalog="alicloud-2023", global_batch_size=B, n_trials=4, storage=url, study_name="s", max_instances=2, progress=False)
    if existing:
        tune(profile, **kw)
    before = _snapshot(tmp_path / "study.db") if existing else None

    def full_disk(rdb, study_id, trials):
        raise sqlalchemy.exc.OperationalError("INSERT INTO trials ...", {}, sqlite3.OperationalError("database or disk is full"))

    monkeypatch.setattr(storage_module, "_bulk_insert", full_disk)
    left = "the study was left as it was" if existing else "the study was not created"
    with pytest.raises(StudyStorageError, match=rf"Writing this run's 4 trials to .* failed \(OperationalError: database or disk is full\); {left}\..*HINT"):
        tune(profile, **kw)
    if existing:
        assert _snapshot(tmp_path / "study.db") == before
    else:
        assert optuna.get_all_study_names(url) == []


def test_a_study_deleted_while_the_run_searches_is_one_clear_error(tmp_path, profile, monkeypatch):
    """`optuna delete-study` on the study a run extends, while it searches: the write found no study, and
    `distplan tune` said "KeyError: Record does not exist. HINT: run with --help for usage" (Optuna's words)."""
    url = _url(tmp_path)
    kw = dict(catalog="alicloud-2023", global_batch_size=B, n_trials=6, storage=url, study_name="s", max_instances=2, progress=False)
    tune(profile, **kw)
    evaluate = ConfigSpace.evaluate

    def delete_then_evaluate(self, *args, **kwargs):
        if "s" in optuna.get_all_study_names(url):
            optuna.delete_study(study_name="s", storage=url)
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(ConfigSpace, "evaluate", delete_then_evaluate)
    with pytest.raises(StudyConflictError, match=r"Study 's' was deleted from .* while this run searched; this run's 6 trials were not written\. HINT: Re-run"):
        tune(profile, **kw)
    assert optuna.get_all_study_names(url) == []


def test_same_settings_resume_the_study(tmp_path, profile):
    url = _url(tmp_path)
    kw = dict(catalog="alicloud-2023", global_batch_size=B, n_trials=12, storage=url, study_name="s", max_instances=2, progress=False)
    first = tune(profile, **kw)
    second = tune(profile, **kw)
    assert second.resumed and second.n_trials == 12 and second.n_study_trials == 24
    assert [t.number for t in optuna.load_study(study_name="s", storage=url).trials] == list(range(24))
    assert second.best.objective <= first.best.objective


def test_feasible_configurations_are_counted_once_however_many_trials_priced_them(tmp_path):
    """A space of a few configurations searched with more trials: n_feasible counted trials (more than the space)."""
    from lightning_distplan.tuner.catalog import parse_catalog_csv

    csv = tmp_path / "one.csv"
    csv.write_text("InstanceType,AcceleratorName,AcceleratorCount,Price,NetworkGbps\ng.one,A10,1,1.0,10\n")
    # a sampler of one's own: by default 12 trials on a space of 3 price each configuration once (no sampler)
    result = tune(make_profile(), catalog=parse_catalog_csv(csv), global_batch_size=4, n_trials=12, storage=_url(tmp_path), study_name="few",
                  max_instances=1, strategies=("dp_ga",), progress=False, sampler=optuna.samplers.TPESampler(seed=0))
    study = optuna.load_study(study_name="few", storage=_url(tmp_path))
    feasible = [frozenset(t.params.items()) for t in study.trials if t.user_attrs.get("feasible")]
    assert len(feasible) > len(set(feasible))  # 12 trials over m in {1, 2, 4}: the same configuration priced again
    assert result.n_feasible == len(set(feasible)) <= result.space_size


@pytest.mark.parametrize(
    ("batch", "strategies", "count", "match"),
    [
        # every trial chose 2 instances, on which dp_ga cannot factor 7: said so, not "fits in memory"
        (7, ("dp_ga",), 2, r"None of the 3 configurations tried is feasible: 3 have no plan that factors the global batch 7 .*"
                           r"HINT: Use a global batch size with more divisors"),
        # a pipeline on 1 device: the reason says so (it said "no gpipe plan factors the global batch 8 on 1 devices")
        (8, ("gpipe",), 1, r"None of the 3 configurations tried is feasible: 3 are pipelines on one device .*HINT: Add dp_ga to --strategy"),
    ],
)
def test_nothing_feasible_names_what_stopped_the_trials(tmp_path, batch, strategies, count, match):
    from lightning_distplan.tuner.catalog import parse_catalog_csv

    csv = tmp_path / "one.csv"
    csv.write_text("InstanceType,AcceleratorName,AcceleratorCount,Price,NetworkGbps\ng.one,A10,1,1.0,10\n")
    sampler = optuna.samplers.PartialFixedSampler({"n_instances": count}, optuna.samplers.RandomSampler(seed=0))
    with pytest.raises(InfeasiblePlanError, match=match):
        tune(make_profile(), catalog=parse_catalog_csv(csv), global_batch_size=batch, n_trials=3, storage=_url(tmp_path), study_name="none",
             max_instances=2, strategies=strategies, progress=False, sampler=sampler)
    reasons = {t.user_attrs["reason"] for t in optuna.load_study(study_name="none", storage=_url(tmp_path)).trials}
    if count == 1:
        assert reasons == {"a pipeline needs at least 2 devices (1 x g.one has 1)"}


def test_multi_objective_nsga2(tmp_path, profile):
    result = tune(profile, catalog="aws-2026", global_batch_size=B, n_trials=20, storage=_url(tmp_path), study_name="mo",
                  max_instances=2, multi_objective=True, progress=False)
    study = optuna.load_study(study_name="mo", storage=_url(tmp_path))
    assert len(study.directions) == 2 and result.sampler == "NSGAIISampler" and result.pareto
    assert result.currency == "USD"
    data = result.to_dict()
    assert data["multi_objective"] and data["objective"].startswith("(C, T) per optimizer step")
    assert result.best.objective == min(c.objective for c in result.pareto)  # best: the lowest C + w*T found
    # the default names differ, so a single-objective run and a multi-objective one never meet in one study
    single = tune(profile, catalog="aws-2026", global_batch_size=B, n_trials=5, storage=_url(tmp_path), max_instances=2, progress=False)
    multi = tune(profile, catalog="aws-2026", global_batch_size=B, n_trials=5, storage=_url(tmp_path), max_instances=2, multi_objective=True,
                 progress=False)
    assert multi.study_name == single.study_name + "-mo" and not single.to_dict()["multi_objective"]
    # optuna-dashboard labels the values (its Pareto-front axes) with the study's metric names: "Objective 0 / 1" without them
    assert study.metric_names == ["cost_per_step", "step_time_s"]
    assert optuna.load_study(study_name=single.study_name, storage=_url(tmp_path)).metric_names == ["cost_per_step + w*step_time_s"]


def test_exhaustive_covers_exactly_the_enumerated_space(profile):
    catalog = load_catalog("alicloud-2023")
    ex = exhaustive(profile, catalog, global_batch_size=B, time_weight=256, max_instances=3)
    expected = sum(len(enumerate_plans(profile, world_size=c, global_batch_size=B)) for _ in catalog.instances for c in (1, 2, 3))
    assert ex.n_evaluations == len(ex.configs) == expected
    assert all(c.plan.global_batch_size == B for c in ex.configs)
    feasible = [c for c in ex.configs if c.feasible]
    assert ex.best.objective == min(c.objective for c in feasible)
    assert math.isclose(ex.best.objective, ex.best.cost_per_step + 256 * ex.best.step_time_s)
    assert ex.pareto == pareto_front(feasible)
    with pytest.raises(InfeasiblePlanError, match="max_configurations"):
        exhaustive(profile, catalog, global_batch_size=B, max_instances=3, max_configurations=10)


def test_a_pipeline_inside_each_instance_hands_over_on_the_gpu_link_not_the_network():
    """Stages are consecutive ranks, so with pp dividing an instance's GPUs each pipeline stays inside one instance: its
    hand-overs go over NVLink (p3.16xlarge: 150 GB/s), only the stages' all-reduce over the 25 Gbit/s network, whose
    one card the 8 stages on an instance cross at once (priced each as alone on it, their all-reduce was 1/8 of this)."""
    from lightning_distplan.costmodel import ring_allreduce_time
    from lightning_distplan.costmodel.gpus import GPUS
    from lightning_distplan.tuner._space import NETWORK_LATENCY_S

    catalog = load_catalog("aws-2026")
    inst = catalog.get("p3.16xlarge")
    space = ConfigSpace(make_profile(n_layers=16), catalog, global_batch_size=B, time_weight=0.0, max_instances=2, strategies=("1f1b",))

    def config(count, pp):
        plan = next(p for p in space.plans(inst.world_size(count)) if p.pp == pp and p.micro_batch_size == 2)
        return space.evaluate(inst, count, plan), space.trial_attrs(space.evaluate(inst, count, plan), inst)["hardware"]

    one, _ = config(1, 8)
    two, links = config(2, 8)
    assert links["p2p_bandwidth_bytes_per_s"] == GPUS["V100"].interconnect_bytes_per_s
    assert links["allreduce_bandwidth_bytes_per_s"] == 25e9 / 8 and links["devices_per_link"] == 8
    assert config(1, 8)[1]["devices_per_link"] == 1  # inside one instance each GPU has its own NVLink lanes
    grads = space.projection(inst)[0].memory.grad_bytes  # the 8 stages on each card: all the gradients, over 2 replicas
    assert two.breakdown["exposed_comm"] == pytest.approx(ring_allreduce_time(grads, 2, NETWORK_LATENCY_S, 25e9 / 8), rel=1e-9)
    # half the micro-batches per pipeline on the same link (was 9x the one-instance time, priced over the network)
    assert two.breakdown["p2p"] < one.breakdown["p2p"]
    _, spanning = config(2, 16)  # a 16-stage pipeline crosses from one instance to the other
    assert spanning["p2p_bandwidth_bytes_per_s"] == 25e9 / 8


@pytest.mark.parametrize(("batch", "strategies", "max_pp"), [(64, ("dp_ga", "gpipe", "1f1b"), None), (96, ("1f1b",), 3), (7, ("dp_ga",), None)])
def test_the_quick_factor_check_never_drops_a_world_the_planner_has_plans_for(profile, batch, strategies, max_pp):
    """The space skips the planner for world sizes with no dp dividing the batch (what made --max-instances 2000 take 30 s)."""
    from lightning_distplan.errors import BatchNotFactorableError

    space = ConfigSpace(profile, load_catalog("alicloud-2023"), global_batch_size=batch, time_weight=0.0, max_instances=2,
                        strategies=strategies, max_pp=max_pp)
    for world in range(1, 130):
        try:
            n = len(enumerate_plans(profile, world_size=world, global_batch_size=batch, strategies=strategies, max_pp=max_pp))
        except (BatchNotFactorableError, ModelSplitError):
            n = 0
        assert (n > 0) <= space._may_factor(world), world  # never skips a world with plans
        assert len(space.plans(world)) == n


def test_pipelines_only_with_max_pp_1_says_a_pipeline_needs_2_stages(tmp_path, profile):
    with pytest.raises(InfeasiblePlanError, match=r"Only pipelines \(gpipe\) are searched, but .* a pipeline needs 2 or more stages, and at most 1 are allowed.*HINT: Raise --max-pp"):
        tune(profile, catalog="alicloud-2023", global_batch_size=B, n_trials=4, storage=_url(tmp_path), strategies=("gpipe",), max_pp=1, progress=False)


def test_pipeline_only_on_an_unsplittable_profile_names_the_split_not_the_batch(tmp_path):
    flat = make_profile(n_layers=4, splittable=False)
    with pytest.raises(ModelSplitError, match=r"cannot be split into pipeline stages \(hand-built\).*HINT: Allow dp_ga"):
        tune(flat, catalog="alicloud-2023", global_batch_size=B, strategies=("gpipe",), n_trials=2, max_instances=2,
             storage=f"sqlite:///{tmp_path / 's.db'}", progress=False)
    with pytest.raises(ModelSplitError, match="only 1 layer"):
        exhaustive(make_profile(n_layers=1), load_catalog("alicloud-2023"), global_batch_size=B, strategies=("1f1b",), max_instances=2)
    # dp_ga among the strategies: the pipelines are dropped and the search runs
    ex = exhaustive(flat, load_catalog("alicloud-2023"), global_batch_size=B, strategies=("dp_ga", "gpipe"), max_instances=2)
    assert ex.configs and {c.plan.strategy for c in ex.configs} == {"dp_ga"}


_APPEND = """
import sys
import _distplan_cli
_distplan_cli.starting = True  # as `distplan tune` imports the package: neither torch nor Lightning (~10 s of CPU)
import optuna
from lightning_distplan.tuner._storage import open_storage, write_trials
optuna.logging.set_verbosity(optuna.logging.ERROR)
url = sys.argv[1]
study = optuna.load_study(study_name="s", storage=open_storage(url))
memory = optuna.create_study()
def objective(trial):
    for k in range(25):
        trial.set_user_attr(f"a{k}", k)
    return trial.suggest_float("x", 0, 1)
memory.optimize(objective, n_trials=300)
print("ready", flush=True)
sys.stdin.readline()  # "go", written to both children at once
write_trials(study, memory.get_trials())
"""


def test_two_runs_extending_one_sqlite_study_at_once_keep_every_trial(tmp_path):
    """Two `tune` runs extending the same study write their trials at the same moment: every trial keeps its
    own number, so Optuna (and the dashboard) sees all of them (numbered from one count, it saw half)."""
    url = f"sqlite:///{tmp_path / 'race.db'}"
    optuna.create_study(study_name="s", storage=url).optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    children = [_spawn(tmp_path, _APPEND, url) for _ in range(2)]
    try:
        # both children import and run their 300 trials first (they once waited for a fixed 12 s from now)
        assert [_line_of(child) for child in children] == ["ready", "ready"]
        for child in children:  # then both write at once
            child.stdin.write("go\n")
            child.stdin.flush()
        for child in children:
            child.stdin.close()
        assert [child.wait(timeout=240) for child in children] == [0, 0], [child.err_path.read_text()[-2000:] for child in children]
    finally:
        _reap(children)
    numbers = [t.number for t in optuna.load_study(study_name="s", storage=url).trials]
    assert sorted(numbers) == list(range(603))


def test_a_run_that_another_run_extended_the_study_under_counts_the_study_as_stored(tmp_path, profile):
    """Two `distplan tune` runs on one SQLite study (reproduced with two processes): the other run wrote its trials
    while this one searched. This one reported the study as it had read it at its start (n_study_trials 5 + 10 where
    the study had 5 + 7 + 10 trials; feasible configurations and best without the other run's), and its best's trial
    number was the one it had in memory, not the one the database gave it. Here a sampler hook runs the other search
    (through its own connection to the file) once this run has read the study: the same interleaving, without the
    seconds a second process takes to import torch."""
    import json

    url = _url(tmp_path)
    common = dict(catalog="alicloud-2023", global_batch_size=B, storage=url, study_name="s", max_instances=2, progress=False)
    tune(profile, n_trials=5, **common)

    class OtherRunMeanwhile(optuna.samplers.TPESampler):
        started = False

        def before_trial(self, study, trial):
            if not self.started:
                self.started = True
                assert tune(profile, n_trials=7, **common).n_study_trials == 12
            super().before_trial(study, trial)

    result = tune(profile, n_trials=10, sampler=OtherRunMeanwhile(seed=0), **common)
    stored = optuna.load_study(study_name="s", storage=url).trials
    assert len(stored) == 22 and result.n_trials == 10 and result.n_study_trials == 22
    feasible = {(t.user_attrs["instance_type"], t.user_attrs["count"], json.dumps(t.user_attrs["plan"], sort_keys=True))
                for t in stored if t.user_attrs.get("feasible") and t.user_attrs.get("objective") is not None}
    assert result.n_feasible == len(feasible)
    best = stored[result.best.trial_number]  # the trial the result names is the one in the study
    assert (best.user_attrs["instance_type"], best.user_attrs["count"], best.user_attrs["objective"]) == (
        result.best.instance_type, result.best.count, result.best.objective)
    assert result.best.objective == min(t.user_attrs["objective"] for t in stored if t.user_attrs.get("feasible"))


_FULL_DISK = """
import resource, sys, os
import _distplan_cli
_distplan_cli.starting = True  # as `distplan tune` imports the package: neither torch nor Lightning (~10 s of CPU)
import optuna
from lightning_distplan.tuner._storage import open_storage, write_trials
optuna.logging.set_verbosity(optuna.logging.ERROR)
url, path = sys.argv[1], sys.argv[2]
study = optuna.load_study(study_name="s", storage=open_storage(url))
memory = optuna.create_study()
def objective(trial):
    for k in range(25):
        trial.set_user_attr(f"a{k}", "x" * 40)
    return trial.suggest_float("x", 0, 1)
memory.optimize(objective, n_trials=300)
size = os.path.getsize(path)
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 64 * 1024, resource.RLIM_INFINITY))  # a disk that fills mid-write
try:
    write_trials(study, memory.get_trials())
except Exception as err:
    print(type(err).__name__)
"""


def test_a_write_the_database_refuses_leaves_the_study_as_it_was(tmp_path):
    """A disk that fills during the one-transaction insert: the error comes back and no trial of the run is in the
    study. Before, any error fell back to Optuna's trial-by-trial add_trials, which committed some (85 of 1500 here
    in a review) while the message said the study was left as it was."""
    import subprocess
    import sys

    path = tmp_path / "full.db"
    url = f"sqlite:///{path}"
    optuna.create_study(study_name="s", storage=url).optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=20)
    child = subprocess.run([sys.executable, "-c", _FULL_DISK, url, str(path)], capture_output=True, text=True, timeout=240)
    assert child.returncode == 0, child.stderr
    assert len(optuna.load_study(study_name="s", storage=url).trials) == 20
    assert child.stdout.strip() == "OperationalError", child.stdout + child.stderr


def _open_at_once(url: str, runs: int = 4) -> tuple[list, list[str]]:
    """``open_storage(url)`` from ``runs`` threads released at the same moment: the storages and the errors."""
    import threading

    from lightning_distplan.tuner._storage import open_storage

    barrier = threading.Barrier(runs)
    opened: list = []
    failed: list[str] = []

    def open_it() -> None:
        barrier.wait()
        try:
            opened.append(open_storage(url))
        except Exception as err:  # noqa: BLE001 - collected and asserted by the caller
            failed.append(str(err))

    threads = [threading.Thread(target=open_it) for _ in range(runs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return opened, failed


def test_runs_opening_one_new_sqlite_file_at_once_all_get_the_storage(tmp_path):
    """Several `tune` runs (here threads) creating one new SQLite file at the same moment: each opens it. Without
    a lock around Optuna's schema creation most of them failed ("table ... already exists", "UNIQUE constraint")."""
    for k in range(3):
        url = f"sqlite:///{tmp_path / f'new{k}.db'}"
        opened, failed = _open_at_once(url)
        assert failed == [] and len(opened) == 4
        optuna.create_study(study_name="s", storage=opened[0]).optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
        assert len(optuna.load_study(study_name="s", storage=opened[3]).trials) == 2  # one schema, shared


def test_runs_opening_one_new_sqlite_file_in_a_folder_they_cannot_lock_all_get_the_storage(tmp_path, monkeypatch):
    """Where the database's folder cannot be opened to lock it (a folder this user may write but not read, mode
    0o333; on NFS, flock refuses a folder's read-only descriptor), the creation lock is a file in the temporary
    folder, as before the folder lock: the runs went on without any lock, and most of them failed."""
    import errno
    import tempfile

    real_open = os.open

    def unreadable_folders(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECTORY", 0) or os.path.isdir(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    monkeypatch.setattr(os, "open", unreadable_folders)
    for k in range(3):
        url = f"sqlite:///{tmp_path / f'new{k}.db'}"
        opened, failed = _open_at_once(url)
        assert failed == [] and len(opened) == 4
    assert len(list(temporary.glob("distplan-sqlite-*.lock"))) == 3  # one per database, left there


def test_opening_a_sqlite_study_leaves_no_lock_file_behind(tmp_path, monkeypatch):
    """The creation lock is taken on the database's folder: each new study file left a lock file of its own in
    the temporary folder before (a test suite had made 1,658 of them in /tmp)."""
    import tempfile

    from lightning_distplan.tuner._storage import open_storage

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    studies = tmp_path / "studies"
    studies.mkdir()
    for k in range(3):
        open_storage(f"sqlite:///{studies / f'new{k}.db'}")
    assert sorted(p.name for p in temporary.iterdir()) == []
    assert sorted(p.name for p in studies.iterdir()) == ["new0.db", "new1.db", "new2.db"]


def test_a_damaged_study_file_is_one_storage_error_and_left_as_it_was(tmp_path):
    """A SQLite study file damaged after its first page: opening answers, reading the study fails. One sentence with
    a HINT (not Optuna's StorageInternalError traceback), nothing searched or written."""
    profile = make_profile()
    url = _url(tmp_path)
    common = dict(catalog="aws-2026", global_batch_size=64, storage=url, study_name="s", max_instances=4, progress=False)
    tune(profile, n_trials=100, **common)
    db = tmp_path / "study.db"
    with open(db, "r+b") as f:
        f.seek(8192)
        f.write(b"\xff" * 4096)
    before = db.read_bytes()
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ConfigSpace, "evaluate", lambda *a, **k: calls.append(a))
        with pytest.raises(StudyStorageError, match=r"(is damaged \(quick_check: .*\)|Reading study 's' from .* failed \(DatabaseError: .*malformed.*); nothing was searched or written.*HINT"):
            tune(profile, n_trials=5, **common)
    assert calls == [] and db.read_bytes() == before


def test_a_new_study_is_not_written_into_a_damaged_file(tmp_path):
    """Damage in the middle of a study file (pages of the trials' rows): the file opens, lists its tables, and a new
    study name reads nothing damaged. The search then wrote its study into the damaged file and reported success;
    the file is refused now as the dashboard refuses it (quick_check), and left as it was."""
    profile = make_profile()
    url = _url(tmp_path)
    common = dict(catalog="aws-2026", global_batch_size=64, storage=url, max_instances=4, progress=False)
    tune(profile, n_trials=100, study_name="s", **common)
    db = tmp_path / "study.db"
    size = db.stat().st_size
    with open(db, "r+b") as f:
        f.seek(size // 2 // 4096 * 4096)
        f.write(b"\xff" * 8192)
    before = db.read_bytes()
    with pytest.raises(StudyStorageError, match=r"is damaged \(quick_check: .*\); nothing was searched or written\. HINT: Keep a copy"):
        tune(profile, n_trials=5, study_name="new", **common)
    assert db.read_bytes() == before


def test_the_same_settings_typed_differently_extend_the_study(tmp_path, profile, monkeypatch):
    """One CSV catalog named by a relative and then an absolute path, and the same strategies in another
    order, are the same settings: the second run extends the study instead of being refused."""
    from lightning_distplan.tuner import parse_catalog_csv

    (tmp_path / "cat.csv").write_text("InstanceType,AcceleratorName,AcceleratorCount,Price,NetworkGbps\ng4dn.xlarge,T4,1,0.526,25\n")
    monkeypatch.chdir(tmp_path)
    url = _url(tmp_path)
    common = dict(global_batch_size=B, n_trials=5, storage=url, study_name="csv", max_instances=2, progress=False)
    tune(profile, catalog=parse_catalog_csv("cat.csv"), strategies=("1f1b", "dp_ga"), **common)
    again = tune(profile, catalog=parse_catalog_csv(str(tmp_path / "cat.csv")), strategies=("dp_ga", "1f1b"), **common)
    assert again.resumed and again.n_study_trials == 10


def test_a_study_made_by_the_previous_version_is_extended(tmp_path, profile):
    """Studies store a fingerprint of the settings; the previous version fingerprinted the catalog rows with their
    source, the profile without `trainable_param_bytes`, and strategies as typed. The same command extends them."""
    import hashlib
    import json

    from lightning_distplan.tuner import load_catalog
    from lightning_distplan.tuner.search import SETTINGS_ATTR

    def old_fingerprint(data):
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]

    url = _url(tmp_path)
    common = dict(global_batch_size=B, n_trials=5, storage=url, study_name="old", max_instances=2, progress=False)
    tune(profile, catalog="aws-2026", strategies=("dp_ga", "gpipe"), **common)
    study = optuna.load_study(study_name="old", storage=url)
    old = dict(study.user_attrs[SETTINGS_ATTR])
    profile_dict = profile.to_dict()
    for layer in profile_dict["layers"]:
        del layer["trainable_param_bytes"]  # the field did not exist
        del layer["conv_flops_forward_per_sample"], layer["conv_flops_backward_per_sample"]  # nor did these
        del layer["output_saved_bytes_per_sample"], layer["output_saved_later_bytes_per_sample"]  # nor these (None here)
    del profile_dict["unused_parameters"], profile_dict["device"]["tf32_matmul"], profile_dict["device"]["tf32_conv"]
    assert old["profile"] == old_fingerprint(profile_dict)
    # network_burst did not exist either
    old["catalog_fingerprint"] = old_fingerprint([{k: v for k, v in i.to_dict().items() if k != "network_burst"}
                                                  for i in load_catalog("aws-2026").instances])
    old["strategies"] = ["gpipe", "dp_ga"]  # as typed
    study.set_user_attr(SETTINGS_ATTR, old)
    again = tune(profile, catalog="aws-2026", strategies=("gpipe", "dp_ga"), **common)
    assert again.resumed and again.n_study_trials == 10


def test_a_profile_file_keeps_the_fingerprint_earlier_versions_gave_it():
    """The fingerprint e16835b (2026-11-25, before `unused_parameters`) stored for a committed profile: a field added
    since must not change it, or `tune` refuses to extend every study made before (it did, at 22d8473)."""
    from lightning_distplan.tuner.search import _profile_fingerprint

    committed = Profile.load(Path(__file__).parents[2] / "benchmarks/results/tuner_vs_exhaustive_profile.json")
    assert not committed.unused_parameters
    assert _profile_fingerprint(committed) == "0f9b3831d8dc548b"
    # and the one versions of 22d8473 to f3ca23f (2026-11-25 to 28) stored, with "unused_parameters": [] in it
    assert _profile_fingerprint(committed, with_empty_unused=True) == "5611c9a9f3daae89"


def test_a_study_whose_fingerprint_has_an_empty_unused_parameters_list_is_extended(tmp_path, profile):
    """Studies made from 22d8473 to f3ca23f fingerprinted the profile with its empty `unused_parameters`; leaving it out
    (e70ec85) refused them all as made from another profile. They are read as this version writes them."""
    from lightning_distplan.tuner.search import SETTINGS_ATTR, _profile_fingerprint

    url = _url(tmp_path)
    common = dict(global_batch_size=B, n_trials=5, storage=url, study_name="s", max_instances=2, progress=False)
    tune(profile, catalog="aws-2026", **common)
    study = optuna.load_study(study_name="s", storage=url)
    settings = dict(study.user_attrs[SETTINGS_ATTR])
    settings["profile"] = _profile_fingerprint(profile, with_empty_unused=True)
    assert settings["profile"] != _profile_fingerprint(profile)
    study.set_user_attr(SETTINGS_ATTR, settings)
    again = tune(profile, catalog="aws-2026", **common)
    assert again.resumed and again.n_study_trials == 10


def test_a_study_a_newer_or_no_distplan_marked_is_refused_and_left_untouched(tmp_path, profile):
    """The study's settings carry the version of distplan's settings format. A study a newer distplan wrote (version 2,
    with a setting this version does not know) was refused as "settings differ: version 2 -> 1, pricing 'spot' ->
    None", with a HINT to delete it; it is named as a newer distplan's now, with a HINT to extend it there. One
    without the marker is refused as before. Neither is changed by a row."""
    from lightning_distplan.tuner.search import SETTINGS_ATTR

    url = _url(tmp_path)
    kw = dict(catalog="alicloud-2023", global_batch_size=B, n_trials=5, storage=url, max_instances=2, progress=False)
    for name in ("newer", "unmarked"):
        tune(profile, study_name=name, **kw)
        study = optuna.load_study(study_name=name, storage=url)
        settings = dict(study.user_attrs[SETTINGS_ATTR])
        if name == "newer":
            settings.update(version=2, pricing="spot")
        else:
            del settings["version"]
        study.set_user_attr(SETTINGS_ATTR, settings)
    before = _snapshot(tmp_path / "study.db")
    with pytest.raises(StudyConflictError, match=r"^Study 'newer' already exists in .* and it was written by a newer distplan \(settings version 2; "
                                                 r"this one writes version 1\); it was left untouched\. HINT: Extend it with the newer "
                                                 r"lightning_distplan that wrote it .*, or pass a new --study-name\.$"):
        tune(profile, study_name="newer", **kw)
    with pytest.raises(StudyConflictError, match=r"^Study 'unmarked' already exists in .* and settings differ: version None -> 1; it was left "
                                                 r"untouched\. HINT: Pass a new --study-name, or delete the old study"):
        tune(profile, study_name="unmarked", **kw)
    assert _snapshot(tmp_path / "study.db") == before


def test_a_newer_distplans_worker_creating_the_study_meanwhile_keeps_it_whole(tmp_path, profile, monkeypatch):
    """Mixed-version workers of one search: a newer distplan's run (its settings version 2) creates the new study while
    this one searches. This run refuses to write into it, names why, and leaves the newer run's study and trials as
    they were."""
    from lightning_distplan.tuner import search

    url = _url(tmp_path)
    kw = dict(catalog="alicloud-2023", global_batch_size=B, storage=url, study_name="s", max_instances=2, progress=False)
    before: list = []

    class NewerRunMeanwhile(optuna.samplers.RandomSampler):
        def before_trial(self, study, trial):
            if trial.number == 0:
                with monkeypatch.context() as patch:
                    patch.setattr(search, "_SETTINGS_VERSION", 2)
                    tune(profile, n_trials=6, **kw)
                before.append(_snapshot(tmp_path / "study.db"))
            super().before_trial(study, trial)

    with pytest.raises(StudyConflictError, match=r"^Study 's' was created in .* by another run while this one searched, and it was written by a "
                                                 r"newer distplan \(settings version 2; this one writes version 1\); it was left untouched and this "
                                                 r"run's 5 trials were not written\. HINT: Extend it with the newer lightning_distplan that wrote it "
                                                 r".* to search on, or pass another --study-name\.$"):
        tune(profile, n_trials=5, sampler=NewerRunMeanwhile(seed=0), **kw)
    assert _snapshot(tmp_path / "study.db") == before[0]
    stored = optuna.load_study(study_name="s", storage=url)
    assert len(stored.trials) == 6 and stored.user_attrs["distplan_settings"]["version"] == 2


def test_two_runs_extending_a_study_an_earlier_version_wrote_keep_its_settings_as_written(tmp_path, profile):
    """Two runs of this version extend, at once, a study an earlier version wrote (its profile fingerprinted with an
    empty `unused_parameters`, the catalog with its rows' sources, the strategies as typed): both read its settings as
    this version writes them and add their trials; the stored settings stay as the earlier version wrote them, so a
    worker of that version still extends the study after them."""
    from lightning_distplan.tuner import load_catalog
    from lightning_distplan.tuner.search import SETTINGS_ATTR, _catalog_fingerprint, _profile_fingerprint

    url = _url(tmp_path)
    common = dict(catalog="aws-2026", strategies=("gpipe", "dp_ga"), global_batch_size=B, storage=url, study_name="s",
                  max_instances=2, progress=False)
    tune(profile, n_trials=5, **common)
    study = optuna.load_study(study_name="s", storage=url)
    old = dict(study.user_attrs[SETTINGS_ATTR])
    old.update(profile=_profile_fingerprint(profile, with_empty_unused=True), strategies=["gpipe", "dp_ga"],
               catalog_fingerprint=_catalog_fingerprint(load_catalog("aws-2026"), with_sources=True))
    assert old != study.user_attrs[SETTINGS_ATTR]
    study.set_user_attr(SETTINGS_ATTR, old)

    class OtherRunMeanwhile(optuna.samplers.RandomSampler):
        def before_trial(self, study, trial):
            if trial.number == 5:  # this run has read the study (5 trials); the other one extends it now
                assert tune(profile, n_trials=4, **common).n_study_trials == 9
            super().before_trial(study, trial)

    result = tune(profile, n_trials=6, sampler=OtherRunMeanwhile(seed=0), **common)
    assert result.resumed and result.n_study_trials == 15
    stored = optuna.load_study(study_name="s", storage=url)
    assert sorted(t.number for t in stored.trials) == list(range(15))
    assert stored.user_attrs[SETTINGS_ATTR] == old


def test_a_foreign_sqlite_file_is_refused_and_left_unchanged(profile, tmp_path):
    """A --storage naming the user's own database (other tables, no Optuna study) or a file that is no database:
    refused before the search, so Optuna's tables are never added to it."""
    app = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(app)) as db:
        db.execute("CREATE TABLE users (id INTEGER)")
        db.commit()
    own = tmp_path / "own.db"  # the user's own table named like Optuna's
    with contextlib.closing(sqlite3.connect(own)) as db:
        db.execute("CREATE TABLE studies (id INTEGER)")
        db.commit()
    text = tmp_path / "notes.db"
    text.write_text("not a database")
    for path, match in ((app, r"holds other tables \(users\), not an Optuna study's.*left unchanged.*HINT: Name a file of its own"),
                        (own, r"holds other tables \(studies\), not an Optuna study's"),
                        (text, r"is not an SQLite database \(it was left unchanged\).*HINT")):
        before = path.read_bytes()
        # the same file under any driver and with its name percent-escaped, as SQLAlchemy reads the URL
        escaped = str(path).replace("/", "%2F").replace(".db", "%2Edb")
        for url in (f"sqlite:///{path}", f"sqlite+pysqlite:///{path}", f"sqlite:///{escaped}"):
            with pytest.raises(StudyStorageError, match=match):
                tune(profile, catalog="alicloud-2023", global_batch_size=B, n_trials=5, storage=url, study_name="x",
                     max_instances=2, progress=False)
            assert path.read_bytes() == before, url


def test_the_local_search_walks_from_tpes_best_to_a_nearby_optimum_within_its_budget():
    """_polish steps from the best trial's *plan* to its best neighbour (instance count and micro-batch halved or
    doubled, stopping at the edges, strategy, stages, instance type) while that improves, in at most its budget."""
    import math

    from lightning_distplan.tuner.search import _neighbours, _polish

    types = ["a", "b"]

    def objective(trial):
        t = trial.suggest_categorical("instance_type", types)
        n = trial.suggest_int("n_instances", 1, 24, log=True)
        s = trial.suggest_categorical("strategy", ["dp_ga", "1f1b"])
        pp = trial.suggest_int("pp", 2, 12, log=True) if s != "dp_ga" else 1
        m = trial.suggest_int("micro_batch_size", 1, 256, log=True)
        trial.set_user_attr("count", n)
        trial.set_user_attr("strategy", s)
        trial.set_user_attr("pp", pp)
        trial.set_user_attr("micro_batch_size", m)
        # best: type b, 24 instances (the edge, not a power of 2 from 3), 1f1b with 12 stages, m = 2
        return (t != "b") + abs(math.log2(n / 24)) + (s != "1f1b") + abs(math.log2(pp / 12)) + abs(math.log2(m / 2))

    def neighbours(p):
        return _neighbours(p, types, 24, 256, ["dp_ga", "1f1b"], 12)

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.enqueue_trial({"instance_type": "a", "n_instances": 3, "strategy": "dp_ga", "micro_batch_size": 16})
    study.optimize(objective, n_trials=1)
    used = _polish(study, objective, 200, neighbours)
    assert study.best_value == 0 and study.best_params == {"instance_type": "b", "n_instances": 24, "strategy": "1f1b", "pp": 12, "micro_batch_size": 2}
    assert used == len(study.trials) - 1 <= 200
    assert len({tuple(sorted(t.params.items())) for t in study.trials}) == len(study.trials)  # no point tried twice
    # out of budget: it stops there
    short = optuna.create_study()
    short.enqueue_trial({"instance_type": "a", "n_instances": 3, "strategy": "dp_ga", "micro_batch_size": 16})
    short.optimize(objective, n_trials=1)
    assert _polish(short, objective, 5, neighbours) == 5 and len(short.trials) == 6
    # the neighbours of a point at the edges stay inside the search space
    edge = neighbours({"instance_type": "a", "n_instances": 24, "strategy": "1f1b", "pp": 12, "micro_batch_size": 256})
    assert all(1 <= p["n_instances"] <= 24 and 1 <= p["micro_batch_size"] <= 256 and 2 <= p.get("pp", 2) <= 12 for p in edge)
    assert {"instance_type": "a", "n_instances": 12, "strategy": "1f1b", "pp": 12, "micro_batch_size": 256} in edge


def test_the_local_search_also_climbs_from_the_best_trial_of_each_other_strategy():
    """Where no single step from the best (data-parallel) trial improves, the climb from the best pipeline trial
    goes on to the optimum: 8 instances of data parallel against 32 of a 2-stage 1F1B, as
    benchmarks/tuner_vs_exhaustive.py found once DDP's buckets were priced in ready order."""
    import math

    from lightning_distplan.tuner.search import _neighbours, _polish

    def objective(trial):
        t = trial.suggest_categorical("instance_type", ["a", "b"])
        n = trial.suggest_int("n_instances", 1, 64, log=True)
        s = trial.suggest_categorical("strategy", ["dp_ga", "1f1b"])
        pp = trial.suggest_int("pp", 2, 8, log=True) if s != "dp_ga" else 1
        m = trial.suggest_int("micro_batch_size", 1, 1024, log=True)
        for key, value in (("count", n), ("strategy", s), ("pp", pp), ("micro_batch_size", m)):
            trial.set_user_attr(key, value)
        if s == "dp_ga":  # a local optimum of 1 at 8 instances, m = 128
            return 3 * (t != "a") + 1 + abs(math.log2(n / 8)) + abs(math.log2(m / 128))
        return 3 * (t != "a") + 0.5 * (abs(math.log2(n / 32)) + abs(math.log2(m / 32)) + abs(math.log2(pp / 2)))

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.enqueue_trial({"instance_type": "a", "n_instances": 8, "strategy": "dp_ga", "micro_batch_size": 128})
    study.enqueue_trial({"instance_type": "a", "n_instances": 4, "strategy": "1f1b", "pp": 2, "micro_batch_size": 64})
    study.optimize(objective, n_trials=2)
    assert study.best_value == 1  # no step from here improves: 1F1B there (8, m = 128) prices 2
    used = _polish(study, objective, 200, lambda p: _neighbours(p, ["a", "b"], 64, 1024, ["dp_ga", "1f1b"], 8))
    assert study.best_value == 0 and study.best_params == {"instance_type": "a", "n_instances": 32, "strategy": "1f1b", "pp": 2, "micro_batch_size": 32}
    assert used == len(study.trials) - 2 <= 200


def test_the_local_search_climbs_on_step_time_where_every_objective_ties_at_a_price_of_0():
    """Free (price 0) instances with w = 0: every configuration's C + w·T is 0. The climb moved only on a lower
    objective, so it stopped after its first step; ties now go to the faster trial, as the result's best does."""
    import math

    from lightning_distplan.tuner.search import _neighbours, _polish

    def objective(trial):
        t = trial.suggest_categorical("instance_type", ["own"])
        n = trial.suggest_int("n_instances", 1, 24, log=True)
        s = trial.suggest_categorical("strategy", ["dp_ga"])
        m = trial.suggest_int("micro_batch_size", 1, 256, log=True)
        for key, value in (("count", n), ("strategy", s), ("pp", 1), ("micro_batch_size", m)):
            trial.set_user_attr(key, value)
        trial.set_user_attr("step_time_s", 1 + abs(math.log2(n / 24)) + abs(math.log2(m / 2)) + (t != "own"))
        return 0.0  # cost 0 per step, weight 0

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.enqueue_trial({"instance_type": "own", "n_instances": 3, "strategy": "dp_ga", "micro_batch_size": 16})
    study.optimize(objective, n_trials=1)
    _polish(study, objective, 200, lambda p: _neighbours(p, ["own"], 24, 256, ["dp_ga"], 1))
    fastest = min(study.trials, key=lambda t: t.user_attrs["step_time_s"])
    assert fastest.user_attrs["step_time_s"] == 1 and fastest.params["n_instances"] == 24 and fastest.params["micro_batch_size"] == 2


def test_progress_bar_counts_every_trial_of_the_search_tpe_local_search_and_rest(tmp_path, profile, capsys):
    # The search runs in parts (TPE, a local search from its best, TPE for what is left): one bar over all of them.
    result = tune(profile, catalog="alicloud-2023", global_batch_size=B, n_trials=40, storage=_url(tmp_path),
                  study_name="s", max_instances=4, progress=True)
    err = capsys.readouterr().err
    assert result.n_trials == 40
    assert "40/40" in err and "best objective" in err, err[-400:]
    assert re.fullmatch(r"TPESampler \+ local search \([1-8] trials\)", result.sampler), result.sampler  # at most a fifth of 40


def test_a_sqlite_uri_filename_with_an_authority_or_escapes_names_its_file(tmp_path):
    """SQLite reads a URI filename (uri=true) with an empty or "localhost" authority and %HH escapes: file://localhost/DIR/x.db
    and file:DIR/my%20dir/x.db open DIR/x.db and DIR/my dir/x.db. The folder check (5ce8aee) took '//localhost/DIR' and
    'my%20dir' for folders and refused both as missing, where Optuna opens them."""
    from lightning_distplan.tuner._storage import open_storage, sqlite_path

    spaced = tmp_path / "my dir"
    spaced.mkdir()
    for url, path in ((f"sqlite:///file://localhost{tmp_path}/a.db?uri=true", tmp_path / "a.db"),
                      (f"sqlite:///file:{tmp_path}/my%20dir/b.db?uri=true", spaced / "b.db"),
                      (f"sqlite:///file://{tmp_path}/c.db?uri=true", tmp_path / "c.db")):
        assert sqlite_path(url) == path, url
        open_storage(url).get_all_studies()
        assert path.is_file(), url


@pytest.mark.parametrize(
    ("search", "kwargs", "match"),
    [
        # the string "no" is true: an NSGA-II search was run and stored as multi-objective
        ("tune", dict(multi_objective="no"), r"^`multi_objective` must be True or False, got 'no'\. HINT:"),
        ("tune", dict(study_name=5), r"^`study_name` must be a string or None, got 5\. HINT:"),
        # an empty name fell back to the default one: another study than the one asked for was created or extended
        ("tune", dict(study_name=""), r"^`study_name` must not be empty, got ''\. HINT: .*study_name=None"),
        ("tune", dict(study_name=" \t"), r"^`study_name` must not be empty, got ' \\t'\. HINT:"),
        # these raised "'>' not supported between instances of 'int' and 'str'" (max_pp was not checked by exhaustive)
        ("exhaustive", dict(max_configurations="10"), r"^`max_configurations` must be an integer >= 1, got '10'\. HINT:"),
        ("exhaustive", dict(max_pp="2"), r"^`max_pp` must be an integer >= 1, got '2'\. HINT:"),
    ],
)
def test_argument_types_are_checked_before_searching(tmp_path, search, kwargs, match):
    with pytest.raises(InfeasiblePlanError, match=match):
        if search == "tune":
            tune(make_profile(), catalog="alicloud-2023", global_batch_size=32, n_trials=3, storage=_url(tmp_path), progress=False, **kwargs)
        else:
            exhaustive(make_profile(), "alicloud-2023", global_batch_size=32, **kwargs)
    assert not list(tmp_path.iterdir())  # refused before the storage was opened


def test_numpy_values_the_checks_above_took_for_python_ones(tmp_path):
    """d78638d's checks took only Python int and bool: exhaustive(max_configurations=np.int64(...)) or
    max_pp=np.int64(2), and tune(multi_objective=np.True_), all run before the checks, were refused."""
    import numpy as np

    python = exhaustive(make_profile(), "alicloud-2023", global_batch_size=32, max_pp=2, max_configurations=100_000)
    numpy = exhaustive(make_profile(), "alicloud-2023", global_batch_size=32, max_pp=np.int64(2), max_configurations=np.int64(100_000))
    assert numpy.best == python.best and numpy.n_evaluations == python.n_evaluations
    result = tune(make_profile(), catalog="alicloud-2023", global_batch_size=32, n_trials=3, storage=_url(tmp_path), progress=False, multi_objective=np.True_)
    assert result.multi_objective is True and result.to_dict()["multi_objective"] is True
    assert len(optuna.load_study(study_name=result.study_name, storage=_url(tmp_path)).directions) == 2  # the (cost, time) search
    with pytest.raises(InfeasiblePlanError, match=r"^`max_configurations` must be an integer >= 1, got np\.True_\. HINT:"):
        exhaustive(make_profile(), "alicloud-2023", global_batch_size=32, max_configurations=np.True_)


def _set_schema(db: Path, revision: str, library_version: str) -> None:
    """Mark an Optuna SQLite file as set up by another Optuna (its alembic revision and recorded library version)."""
    with contextlib.closing(sqlite3.connect(db)) as con:
        con.execute("UPDATE alembic_version SET version_num = ?", (revision,))
        con.execute("UPDATE version_info SET library_version = ?", (library_version,))
        con.commit()


def test_a_study_file_of_another_optuna_schema_gets_the_hint_that_fixes_it(tmp_path, profile):
    """A study file from an older Optuna (schema revision v3.0.0.d, Optuna 3.1) is refused by Optuna itself; the HINT
    said to check the URL, the server and its driver. It names `optuna storage upgrade` now (and, for a newer
    Optuna's file, updating Optuna), the file is left as it was, and the command it names makes the study extendable."""
    import subprocess
    import sys

    url = _url(tmp_path)
    common = dict(catalog="aws-2026", global_batch_size=B, storage=url, study_name="s", max_instances=2, progress=False)
    tune(profile, n_trials=10, **common)
    db = tmp_path / "study.db"
    _set_schema(db, "v3.0.0.d", "3.1.0")
    before = db.read_bytes()
    with pytest.raises(StudyStorageError, match=r"no longer compatible with the table schema.* HINT: The study database was set up by an "
                       r"older Optuna than this one \(.*\): keep a copy of it, then upgrade its schema with "
                       rf"`optuna storage upgrade --storage {re.escape(url)}`; or pass another --storage\.$"):
        tune(profile, n_trials=5, **common)
    assert db.read_bytes() == before
    optuna_cli = Path(sys.executable).parent / "optuna"
    if optuna_cli.exists():  # the command the HINT names, as the user runs it
        subprocess.run([str(optuna_cli), "storage", "upgrade", "--storage", url], check=True, capture_output=True)
        assert tune(profile, n_trials=5, **common).n_study_trials == 15

    _set_schema(db, "v99.0.0.a", "99.0.0")  # a revision this Optuna does not know: a newer one's
    with pytest.raises(StudyStorageError, match=r"HINT: The study database was set up by a newer Optuna than this one \(.*\): use that "
                       r"version \(pip install -U optuna\), or pass another --storage\.$"):
        tune(profile, n_trials=5, **common)


@pytest.mark.parametrize("strategies, match", [
    ([], r"`strategies` is empty.*HINT: Pass one or more of dp_ga, gpipe, 1f1b"),
    ("dp_ga", r"must be a list of strategy names, got the string 'dp_ga'.*HINT: Pass a list, e\.g\. strategies=\['dp_ga'\]"),
    (None, r"must be a list of strategy names, got None.*HINT"),
    (["dp_ga", "zero"], r"Unknown strategies \['zero'\].*HINT: Choose from dp_ga, gpipe, 1f1b"),
])
def test_bad_strategies_are_named_before_the_search(tmp_path, profile, strategies, match):
    """strategies=[] was reported as "No configuration of up to 8 instances factors the global batch size 64" (the
    batch was fine), and strategies="dp_ga" as the unknown strategies ['d', 'p', '_', 'g', 'a']; None was a TypeError."""
    with pytest.raises(InfeasiblePlanError, match=match):
        tune(profile, catalog="aws-2026", global_batch_size=B, n_trials=2, storage=_url(tmp_path), strategies=strategies, progress=False)
    with pytest.raises(InfeasiblePlanError, match=match):
        exhaustive(profile, "aws-2026", global_batch_size=B, strategies=strategies)
    with pytest.raises(InfeasiblePlanError, match=match):  # the planner says the same
        enumerate_plans(profile, world_size=2, global_batch_size=B, strategies=strategies)
    assert not (tmp_path / "study.db").exists()  # refused before any storage was touched


@pytest.mark.parametrize(("url", "module", "package"), [("mysql+pymysql://u:secret@localhost/db", "pymysql", "PyMySQL"),
                                                        ("postgresql+psycopg2://u:secret@localhost/db", "psycopg2", "psycopg2-binary")])
def test_a_storage_url_whose_driver_is_missing_names_the_driver_and_its_install(profile, url, module, package):
    """Optuna says only "Failed to import DB access module for the specified storage URL. Please install appropriate
    one.", and the HINT was the generic one (check the URL, the server, the driver): which driver, installed how?"""
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    shown = url.replace("secret", r"\*\*\*").replace("+", r"\+")
    with pytest.raises(StudyStorageError, match=rf"^Cannot open the study storage '{shown}': its database driver '{module}' is not "
                                                rf"installed\. HINT: Install it \(pip install {package}\)"):
        tune(profile, catalog="alicloud-2023", global_batch_size=B, n_trials=5, storage=url, study_name="x", max_instances=2, progress=False)
    from lightning_distplan.tuner._dashboard import StorageUnreachableError, open_storage

    with pytest.raises(StorageUnreachableError, match=rf"its database driver '{module}' is not installed\. HINT: Install it \(pip install {package}\)"):
        open_storage(url)


def test_a_worker_with_another_seed_extends_the_study(tmp_path, profile):
    """Workers of one search on one study need their own seeds: with one seed they draw the same trials (two
    `distplan tune --trials 200` processes stored 400 trials and the 83 feasible configurations one of them found),
    and a run with another seed was refused ("settings differ: seed 0 -> 1"). The seed picks which configurations are
    priced, not their prices."""
    url = _url(tmp_path)
    kw = dict(catalog="alicloud-2023", global_batch_size=B, storage=url, study_name="s", max_instances=4, progress=False)
    first = tune(profile, n_trials=20, seed=0, **kw)
    second = tune(profile, n_trials=20, seed=1, **kw)
    assert second.resumed and second.n_study_trials == 40 and second.n_feasible > first.n_feasible
    with pytest.raises(StudyConflictError, match=r"settings differ: max_instances 4 -> 2;"):  # the other settings still count
        tune(profile, n_trials=5, seed=1, **{**kw, "max_instances": 2})


def _priced(url: str) -> list[tuple]:
    """The configurations a study's trials priced, in trial order."""
    fields = ("instance_type", "count", "strategy", "dp", "pp", "micro_batch_size")
    return [tuple(t.user_attrs.get(k) for k in fields) for t in optuna.load_study(study_name="s", storage=url).trials]


def test_workers_started_on_one_study_at_once_with_one_seed_spread_out_and_a_run_alone_is_reproducible(tmp_path, profile):
    """Two `distplan tune --trials 100` processes started at once on one SQLite study, both on the default seed, drew
    the same trials: 200 stored, 63 distinct configurations (one run of 200 priced 103). A run started while another
    runs on the study (here from inside that run's search) is worker 1: its own seed, no initial corners."""
    kw = dict(catalog="alicloud-2023", global_batch_size=B, study_name="s", max_instances=4, progress=False)
    alone = _url(tmp_path, "alone.db")
    tune(profile, n_trials=10, storage=alone, **kw)
    url = _url(tmp_path, "workers.db")
    second: list = []

    class FirstWorker(optuna.samplers.RandomSampler):
        def before_trial(self, study, trial):
            if trial.number == 0:  # while this run searches, another run of the same command starts on the study
                second.append(tune(profile, n_trials=10, storage=url, **kw))
            super().before_trial(study, trial)

    tune(profile, n_trials=2, storage=url, sampler=FirstWorker(seed=0), **kw)
    worker = _priced(url)[:10]  # the second run wrote first
    assert len(set(worker) & set(_priced(alone))) <= 3, (worker, _priced(alone))
    assert "(worker 1 of this study on this machine: seed " in second[0].sampler
    again = _url(tmp_path, "again.db")  # its slot is free again: a run alone draws as before (one seed, one search)
    assert tune(profile, n_trials=10, storage=again, **kw).sampler == "TPESampler" and _priced(again) == _priced(alone)


def test_a_worker_whose_next_lock_file_cannot_be_opened_passes_it_over_instead_of_taking_worker_0(tmp_path):
    """With worker 0 held and worker 1's lock file not openable (another user's, under fs.protected_regular; here a
    folder in its place), a second run took worker 0 too: the first run's seed, so the same draws."""
    import hashlib
    import tempfile

    from lightning_distplan.tuner._storage import worker_slot

    url = _url(tmp_path, "w.db")
    key = hashlib.sha256(f"{(tmp_path / 'w.db').resolve()}\0s".encode()).hexdigest()[:20]
    blocker = Path(tempfile.gettempdir()) / f"distplan-worker-{key}-1.lock"
    with worker_slot(url, "s") as first:
        blocker.mkdir()
        try:
            with worker_slot(url, "s") as second:
                assert (first, second) == (0, 2)
        finally:
            blocker.rmdir()


@pytest.mark.parametrize("name", ["it's", "-x"])
def test_the_refusal_hint_names_the_delete_command_for_this_study_and_it_works(tmp_path, profile, name):
    """The HINT said `optuna delete-study --study-name NAME --storage URL`: the command, with this study's name and URL
    (a name starting with '-' after a space was an option to the optuna CLI: "argument --study-name: expected one argument")."""
    import shlex
    import subprocess
    import sys

    url = _url(tmp_path, "my studies.db")  # a space: the command quotes it
    kw = dict(catalog="alicloud-2023", global_batch_size=B, storage=url, study_name=name, max_instances=2, progress=False)
    tune(profile, n_trials=5, **kw)
    with pytest.raises(StudyConflictError) as refused:
        tune(profile, n_trials=5, time_weight=1.0, **kw)
    command = re.search(r"\(`(optuna delete-study [^`]*)`\)", str(refused.value)).group(1)
    assert shlex.split(command)[2:] == [f"--study-name={name}", f"--storage={url}"]
    optuna_cli = Path(sys.executable).with_name("optuna")
    subprocess.run([str(optuna_cli), *shlex.split(command)[1:]], check=True, capture_output=True, timeout=120)
    assert tune(profile, n_trials=5, time_weight=1.0, **kw).n_study_trials == 5  # the name is free again


def test_the_delete_command_of_a_url_with_a_password_says_to_put_the_password_back():
    """For postgresql+psycopg2://dp:s3cr3t@host/db (reproduced on a local PostgreSQL 15) the refusal HINT showed the
    command with --storage='postgresql+psycopg2://dp:***@...' and no word that *** stands for the password: run as
    shown, it fails to log in."""
    from lightning_distplan.tuner.search import _delete_command

    hidden = _delete_command("s", "postgresql+psycopg2://dp:s3cr3t@127.0.0.1:55432/postgres")
    assert hidden == ("`optuna delete-study --study-name=s --storage='postgresql+psycopg2://dp:***@127.0.0.1:55432/postgres'`, "
                      "with your password in place of ***")
    assert "s3cr3t" not in hidden
    assert _delete_command("s", "sqlite:///a.db") == "`optuna delete-study --study-name=s --storage=sqlite:///a.db`"  # nothing hidden


@pytest.mark.parametrize("multi_objective", [False, True])
def test_trials_for_every_configuration_price_each_once_and_samplers_extend_the_study(tmp_path, profile, multi_objective):
    """With --trials at least the size of the space, TPE mostly drew priced configurations again (2000 trials took 193 s
    and priced 239 of 264, where exhaustive() prices all 264 in 0.5 s): each configuration is now priced once and
    stored as the trial a search that drew it stores, so a later run's sampler extends the study as usual."""
    url = _url(tmp_path)
    kw = dict(catalog="alicloud-2023", global_batch_size=B, storage=url, study_name="all", max_instances=1, progress=False,
              multi_objective=multi_objective)
    ex = exhaustive(profile, "alicloud-2023", global_batch_size=B, max_instances=1)
    size = ex.n_evaluations  # 84 configurations
    result = tune(profile, n_trials=size + 100, **kw)
    assert result.n_trials == result.n_study_trials == result.n_evaluations == result.space_size == size
    assert result.sampler == f"none: {size + 100} trials asked >= the {size} configurations left to price, so each was priced once"
    assert result.n_feasible == ex.n_feasible
    assert [c.key for c in result.pareto] == [c.key for c in ex.pareto]
    if not multi_objective:
        assert result.best.key == ex.best.key and result.best.objective == ex.best.objective
    trials = optuna.load_study(study_name="all", storage=url).trials
    keys = {(t.user_attrs["instance_type"], t.user_attrs["count"], t.user_attrs["strategy"], t.user_attrs["dp"], t.user_attrs["pp"],
             t.user_attrs["micro_batch_size"]) for t in trials}
    assert keys == {c.key for c in ex.configs} and len(trials) == size
    assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials) == ex.n_feasible
    assert all(t.state == optuna.trial.TrialState.PRUNED and t.user_attrs["feasible"] is False for t in trials if t.values is None)
    # nothing is left to price; a sampler still reads these trials (the search's distributions; re-priced as stored)
    done = tune(profile, n_trials=8, **kw)
    assert done.n_trials == 0 and done.n_study_trials == size and done.sampler.startswith("none: the study had priced every configuration")
    sampler = optuna.samplers.NSGAIISampler(seed=1) if multi_objective else optuna.samplers.TPESampler(seed=1)
    more = tune(profile, n_trials=8, sampler=sampler, **kw)
    assert more.resumed and more.n_study_trials == size + 8 and more.sampler == type(sampler).__name__


def test_trials_for_every_configuration_a_study_has_not_priced_price_just_those(tmp_path, profile):
    """A study TPE priced part of, extended with at least as many trials as configurations it lacks: those are priced, once each."""
    url = _url(tmp_path)
    kw = dict(catalog="alicloud-2023", global_batch_size=B, storage=url, study_name="rest", max_instances=1, progress=False)
    first = tune(profile, n_trials=30, **kw)
    size = first.space_size
    fields = ("instance_type", "count", "strategy", "dp", "pp", "micro_batch_size")
    priced = {tuple(t.user_attrs[k] for k in fields) for t in optuna.load_study(study_name="rest", storage=url).trials if "dp" in t.user_attrs}
    left = size - len(priced)
    assert 0 < left < size
    rest = tune(profile, n_trials=left, **kw)
    assert rest.n_trials == left and rest.n_study_trials == 30 + left and rest.sampler.startswith(f"none: {left} trials asked >= the {left} configurations")
    assert rest.n_feasible == exhaustive(profile, "alicloud-2023", global_batch_size=B, max_instances=1).n_feasible


def test_a_run_opening_a_sqlite_file_another_run_is_creating_waits_for_its_schema(tmp_path):
    """Workers started together on one new file: one creates Optuna's schema (table by table) under the creation lock,
    and another, looking at the file before taking the lock, saw part of the tables and was refused as someone else's
    database ("holds other tables (studies), not an Optuna study's"; a flaky failure of the open-at-once tests under
    load). Here Optuna's own schema creation pauses after its first table; the other run waits for it and opens the file."""
    import threading

    from optuna.storages._rdb import models
    from sqlalchemy import event

    from lightning_distplan.tuner._storage import open_storage

    url = f"sqlite:///{tmp_path / 'new.db'}"
    creating, asked = threading.Event(), threading.Event()
    outcome: dict = {}

    def pause(*args, **kwargs) -> None:  # after CREATE TABLE studies, before the other tables
        creating.set()
        asked.wait(3)

    def open_in(key: str) -> None:
        try:
            outcome[key] = open_storage(url)
        except Exception as err:  # noqa: BLE001 - asserted below
            outcome[key] = err

    event.listen(models.StudyModel.__table__, "after_create", pause)
    try:
        creator = threading.Thread(target=open_in, args=("creator",))
        creator.start()
        assert creating.wait(60)
        open_in("other")
        asked.set()
        creator.join(60)
    finally:
        event.remove(models.StudyModel.__table__, "after_create", pause)
    assert not isinstance(outcome["other"], Exception), outcome["other"]
    assert not isinstance(outcome["creator"], Exception), outcome["creator"]
    assert optuna.get_all_study_names(url) == []
