"""`import lightning_distplan` registers its strategy names in Lightning's StrategyRegistry."""

from __future__ import annotations

import importlib.util

import lightning as L
from lightning.pytorch.strategies import StrategyRegistry


def test_import_registers_strategies() -> None:
    import lightning_distplan  # noqa: F401
    from lightning_distplan.strategies import DPGAStrategy

    assert StrategyRegistry["dp_ga"]["strategy"] is DPGAStrategy
    assert "lightning_distplan" in StrategyRegistry["dp_ga"]["description"]
    # the pipeline schedules are registered when pipeline.py is importable (it is developed alongside)
    if importlib.util.find_spec("lightning_distplan.strategies.pipeline") is not None:
        from lightning_distplan.strategies.pipeline import PipelineStrategy

        assert StrategyRegistry["gpipe"]["strategy"] is PipelineStrategy
        assert StrategyRegistry["1f1b"]["strategy"] is PipelineStrategy
    if importlib.util.find_spec("lightning_distplan.strategies.auto_plan") is not None:
        assert "auto_plan" in StrategyRegistry


def test_register_strategies_skips_names_already_present() -> None:
    import lightning_distplan  # noqa: F401
    from lightning_distplan.strategies import register_strategies

    entry = StrategyRegistry["dp_ga"]
    assert register_strategies() == []  # a second call registers nothing ...
    assert StrategyRegistry["dp_ga"] is entry  # ... and replaces nothing


def test_trainer_builds_with_dp_ga_by_name() -> None:
    import lightning_distplan  # noqa: F401
    from lightning_distplan.strategies import DPGAStrategy

    trainer = L.Trainer(strategy="dp_ga", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, DPGAStrategy)
    assert trainer.strategy.plan is None  # planned once the train loader is known
    if "1f1b" in StrategyRegistry:
        assert StrategyRegistry["1f1b"]["init_params"] == {"schedule": "1f1b"}
        assert StrategyRegistry["gpipe"]["init_params"] == {"schedule": "gpipe"}


def test_every_public_name_resolves():
    import lightning_distplan

    for name in lightning_distplan.__all__:
        assert getattr(lightning_distplan, name) is not None, name
    from lightning_distplan import StepTimeMonitor
    from lightning_distplan.callbacks import StepTimeMonitor as same

    assert StepTimeMonitor is same
