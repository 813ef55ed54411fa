"""Plan: validated on construction (DESIGN §3.1, every plan factors the global batch), JSON round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_distplan.errors import InfeasiblePlanError, ProfileFormatError
from lightning_distplan.plan import PLAN_SCHEMA_VERSION, Plan

PIPE = dict(strategy="1f1b", dp=2, pp=2, micro_batch_size=2, n_microbatches=4, global_batch_size=16, stage_boundaries=(3,), layer_names=tuple("abcdef"))


def test_derived_fields():
    dp = Plan(strategy="dp_ga", dp=4, micro_batch_size=2, accumulate_grad_batches=3, global_batch_size=24)
    assert (dp.kind, dp.schedule, dp.world_size, dp.steps_per_replica) == ("dp", "none", 4, 3)
    pipe = Plan(**PIPE)
    assert (pipe.kind, pipe.schedule, pipe.world_size, pipe.steps_per_replica) == ("hybrid", "1f1b", 4, 4)
    assert pipe.describe() == "1f1b dp=2 pp=2 m=2 n_microbatches=4 split=[3]"
    # a pipeline under Trainer(accumulate_grad_batches=2): two flushes of n micro-batches per optimizer step
    flushes = Plan(**{**PIPE, "accumulate_grad_batches": 2, "global_batch_size": 32})
    assert (flushes.steps_per_replica, flushes.describe()) == (8, "1f1b dp=2 pp=2 m=2 n_microbatches=4 accumulate=2 split=[3]")
    assert Plan.from_json(flushes.to_json()) == flushes


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(micro_batch_size=3), r"dp \(2\) \* micro_batch_size \(3\) \* n_microbatches \(4\) = 24 does not equal the global batch size \(16\)"),
        (dict(strategy="zero"), r"Unknown strategy 'zero'. HINT: Use one of dp_ga, gpipe, 1f1b"),
        (dict(dp=0), r"`dp` must be a positive integer, got 0"),
        (dict(pp=True), r"`pp` must be a positive integer, got True"),
        (dict(pp=4, dp=1, n_microbatches=2, micro_batch_size=8, stage_boundaries=(1, 2, 3)), r"`n_microbatches` \(2\) must be >= the number of pipeline stages \(4\) for 1F1B"),
        (dict(stage_boundaries=(0,)), r"must be 1 strictly increasing positive layer indices"),
        (dict(stage_boundaries=(6,)), r"point past the last of 6 layers"),
        (dict(accumulate_grad_batches=2), r"\* n_microbatches \(4\) \* accumulate_grad_batches \(2\) = 32 does not equal the global batch size \(16\)"),
        (dict(strategy="gpipe", pp=1, dp=4, n_microbatches=2, stage_boundaries=()), r"needs at least 2 pipeline stages"),
    ],
)
def test_invalid_plans_are_named(over, match):
    with pytest.raises(InfeasiblePlanError, match=match) as info:
        Plan(**{**PIPE, **over})
    assert str(info.value).count("HINT: ") == 1


def test_dp_ga_rejects_pipeline_fields():
    with pytest.raises(InfeasiblePlanError, match=r"A dp_ga plan has pp=1 and n_microbatches=1, got pp=2"):
        Plan(strategy="dp_ga", dp=1, pp=2, micro_batch_size=8, global_batch_size=16)


def test_json_round_trip_from_text_and_file(tmp_path: Path):
    plan = Plan(**PIPE)
    data = plan.to_dict()
    assert data["schema_version"] == PLAN_SCHEMA_VERSION and data["schedule"] == "1f1b" and data["stage_boundaries"] == [3]
    assert Plan.from_json(plan.to_json()) == plan
    for name in ("plan.json", "plan.txt"):  # a file is read whatever its suffix
        path = tmp_path / name
        plan.to_json(path)
        loaded = Plan.from_json(path)
        assert loaded == plan and loaded.layer_names == plan.layer_names
        assert Plan.from_json(str(path)) == plan


@pytest.mark.parametrize(
    "source,match",
    [
        ("missing", r"Plan file .*nope.json' does not exist"),
        ("dir", r"does not exist or is not a file"),
        ('{"strategy": ', r"The plan is not valid JSON"),
        ('{"schema_version": 7}', r"Plan schema version 7 is not supported"),
        # a version that equals 1 in Python but is not the integer 1 (Profile refuses these the same way)
        ('{"schema_version": true, "strategy": "dp_ga", "global_batch_size": 4, "micro_batch_size": 4}', r"Plan schema version True is not supported"),
        ('{"schema_version": 1.0, "strategy": "dp_ga", "global_batch_size": 4, "micro_batch_size": 4}', r"Plan schema version 1\.0 is not supported"),
        ('{"strategy": "dp_ga"}', r"The plan has no global_batch_size, micro_batch_size\."),
        ('{"plan": {"strategy": "dp_ga"}, "prediction": {}}', r"The plan has no global_batch_size, micro_batch_size\."),
        ("[" * 100_000 + "]" * 100_000, r"The plan is not a plan \(its JSON is nested too deeply to read\)"),
        ('{"global_batch_size": ' + "9" * 5000 + "}", r"The plan holds a number too long to be a plan's"),
    ],
)
def test_bad_plan_files_are_format_errors(tmp_path: Path, source: str, match: str):
    arg = str(tmp_path / "nope.json") if source == "missing" else str(tmp_path) if source == "dir" else source
    with pytest.raises(ProfileFormatError, match=match + r".*HINT: "):
        Plan.from_json(arg)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("stage_boundaries", "ab", "must be a list of whole layer indices, got 'ab'"), ("stage_boundaries", 5, "got 5"),
     ("stage_boundaries", [1.9], r"got \[1.9\]"), ("layer_names", 5, "`layer_names` must be a list of layer names")],
)
def test_a_plan_with_malformed_boundaries_or_names_is_refused_not_truncated(field, value, message):
    base = dict(strategy="gpipe", dp=1, pp=2, micro_batch_size=2, n_microbatches=4, global_batch_size=8)
    with pytest.raises(InfeasiblePlanError, match=message + ".*HINT"):
        Plan.from_dict({**base, field: value})


@pytest.mark.parametrize(("strategy", "schedule"), [("1f1b", "gpipe"), ("dp_ga", "1f1b"), ("gpipe", None)])
def test_a_schedule_that_contradicts_the_strategy_is_refused(strategy, schedule):
    """to_dict writes `schedule` beside `strategy`; a plan.json edited to schedule: gpipe ran 1F1B without a word."""
    base = dict(strategy=strategy, dp=1, pp=2, micro_batch_size=2, n_microbatches=4, global_batch_size=8)
    if strategy == "dp_ga":
        base.update(pp=1, n_microbatches=1, micro_batch_size=8)
    data = {**Plan(**base).to_dict(), "schedule": schedule}
    with pytest.raises(InfeasiblePlanError, match=rf"^The plan's schedule {schedule!r} contradicts its strategy '{strategy}'.*HINT: Edit `strategy`"):
        Plan.from_json(json.dumps(data))
    assert Plan.from_dict(Plan(**base).to_dict()) == Plan(**base)  # as written, and without the field
    assert Plan.from_dict({k: v for k, v in Plan(**base).to_dict().items() if k != "schedule"}) == Plan(**base)


def test_whole_numbers_of_any_integer_type_are_boundaries():
    import numpy as np

    base = dict(strategy="gpipe", dp=1, pp=2, micro_batch_size=2, n_microbatches=4, global_batch_size=8)
    assert Plan(**base, stage_boundaries=[np.int64(3)]).stage_boundaries == (3,) == Plan(**base, stage_boundaries=(3.0,)).stage_boundaries


def test_plan_json_text_that_is_not_an_object_is_not_taken_for_a_path():
    with pytest.raises(ProfileFormatError, match="must be a JSON object, got list"):
        Plan.from_json("[1]")


def test_numpy_integers_become_python_ints():
    """Counts computed with numpy are taken, and stored as Python ints (plan.json, checkpoints, equality)."""
    np = pytest.importorskip("numpy")
    plan = Plan(**{**PIPE, "dp": np.int64(2), "micro_batch_size": np.int32(2), "global_batch_size": np.int64(16), "stage_boundaries": [np.int64(3)]})
    assert plan == Plan(**PIPE) and all(type(v) is int for v in (plan.dp, plan.micro_batch_size, plan.global_batch_size, *plan.stage_boundaries))
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(InfeasiblePlanError, match=r"`dp` must be a positive integer, got np.float64\(2.0\)"):
        Plan(**{**PIPE, "dp": np.float64(2)})


def test_to_json_writes_atomically_and_refuses_a_folder(tmp_path: Path):
    """Plan.to_json(path) replaces the file by a rename from a temporary one (as Profile.save): the old plan stays
    whole until the new one is complete, and no temporary file is left; a folder as the path is refused."""
    import json
    import os

    from lightning_distplan.errors import OutputPathError

    plan = Plan(**PIPE)
    path = tmp_path / "plan.json"
    path.write_text("old plan")
    before = os.stat(path).st_ino
    plan.to_json(path)
    assert os.stat(path).st_ino != before  # a new file renamed over the old, not the old one rewritten in place
    assert Plan.from_json(path) == plan and json.loads(path.read_text())["schema_version"] == PLAN_SCHEMA_VERSION
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    with pytest.raises(OutputPathError, match="is a directory"):
        plan.to_json(tmp_path)
