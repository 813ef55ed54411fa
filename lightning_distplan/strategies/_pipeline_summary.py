"""Lightning's model summary of the whole module, taken before a pipeline cuts it into stages.

Lightning's ``ModelSummary`` callback summarises the module at ``on_fit_start``, after the strategy's ``setup``. By
then each rank of a pipeline holds only its own stage (the other stages' tensors are empty), so the summary
counted rank 0's stage alone, and a module with an ``example_input_array`` failed in the summary's forward pass
("mat2 must be a matrix"). The strategy takes the summary before the cut, and the callback prints that one.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary

__all__ = ["summarize_whole_module", "forget_whole_module_summaries"]

_TAKEN = "_distplan_whole_module_summary"  # on a callback whose next summary is the one taken before the cut


class _TakenSummary:
    """What a ``ModelSummary`` summary reported when it was taken: its properties' values and its table's data."""

    def __init__(self, summary: Any) -> None:
        self._data = summary._get_summary_data()
        for cls in reversed(type(summary).__mro__):
            for name, attr in vars(cls).items():
                if isinstance(attr, property) and not name.startswith("_"):
                    with contextlib.suppress(Exception):  # a figure that cannot be computed is left out, as the callback's
                        setattr(self, name, getattr(summary, name))

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        return self._data


@contextlib.contextmanager
def _without_example_input(module: pl.LightningModule) -> Iterator[None]:
    saved = module.example_input_array
    module.example_input_array = None
    try:
        yield
    finally:
        module.example_input_array = saved


def summarize_whole_module(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    """Summarise ``module`` now, whole, for every ``ModelSummary`` callback (``RichModelSummary`` too) of ``trainer``;
    the callback's next summary (this fit's, at ``on_fit_start``) is this one.

    Only global rank 0 prints the summary, so only it runs the ``example_input_array`` forward pass (on the whole
    module, where it is now: the CPU before the model moves to its device). The other ranks' callbacks get the
    summary without it.
    """
    from lightning.pytorch.utilities.model_summary import summarize

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if not isinstance(callback, ModelSummary) or not callback._max_depth:
            continue
        context = contextlib.nullcontext() if trainer.is_global_zero else _without_example_input(module)
        with context:
            taken = _TakenSummary(summarize(module, max_depth=callback._max_depth))

        def once(trainer: pl.Trainer, pl_module: pl.LightningModule, callback: ModelSummary = callback, taken: _TakenSummary = taken) -> Any:
            forget_whole_module_summaries([callback])
            return taken

        callback.__dict__[_TAKEN] = True
        callback._summary = once  # type: ignore[method-assign]


def forget_whole_module_summaries(callbacks: Any) -> None:
    """Give the callbacks their own summary again (after this fit's, or when the fit stopped before it)."""
    for callback in callbacks:
        if callback.__dict__.pop(_TAKEN, False):
            callback.__dict__.pop("_summary", None)
