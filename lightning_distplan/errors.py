"""Exceptions raised by lightning_distplan.

Every error a user can cause is one of these: a built-in exception type (so ``except ValueError``
keeps working) that is also a :class:`DistPlanError`, with a message of one sentence that names
the value found and the rule, followed by ``HINT:`` and the fix.
"""

from __future__ import annotations

__all__ = [
    "DistPlanError",
    "ProfileFormatError",
    "InfeasiblePlanError",
    "BatchNotFactorableError",
    "ModelSplitError",
    "CatalogError",
    "DeviceUnavailableError",
    "BatchFormatError",
    "CheckpointMismatchError",
    "DemoArgumentError",
    "OutputPathError",
    "ProfilingError",
    "DataLoadingError",
]


class DistPlanError(Exception):
    """Base of every error this package raises on bad input."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        if hint:
            message = f"{message} HINT: {hint}"
        super().__init__(message)


class ProfileFormatError(DistPlanError, ValueError):
    """A Profile (or Plan) JSON file is missing, corrupt or of an unsupported schema version."""


class InfeasiblePlanError(DistPlanError, ValueError):
    """No plan fits in memory, or a pinned plan is impossible."""


class BatchNotFactorableError(DistPlanError, ValueError):
    """The global batch cannot be factored over the world size."""


class ModelSplitError(DistPlanError, ValueError):
    """The model cannot be split into pipeline stages as asked."""


class CatalogError(DistPlanError, ValueError):
    """A cloud catalog is unknown or malformed."""


class DeviceUnavailableError(DistPlanError, RuntimeError):
    """A device that was asked for is not present."""


class _UnquotedKeyError(DistPlanError, KeyError):
    """A KeyError whose ``str()`` is its sentence (the built-in one quotes its argument like a key)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else super().__str__()


class BatchFormatError(_UnquotedKeyError, TypeError):
    """A training batch lacks a field the pipeline needs (e.g. labels), or is of a type it cannot read."""


class CheckpointMismatchError(_UnquotedKeyError, ValueError):
    """A checkpoint does not match the model or optimizer it is loaded into (missing entries, other param groups)."""


class DemoArgumentError(DistPlanError, ValueError):
    """An argument of a :mod:`lightning_distplan.demos` data module or model is out of range or unknown."""


class OutputPathError(DistPlanError, ValueError, OSError):
    """A file this package was asked to write cannot be written there (a folder, under a file, not writable), or writing it
    failed (a full disk or quota, permission denied).

    An ``OSError`` as well as a ``ValueError`` (as before), so ``except OSError`` around a save catches it; ``errno`` is
    the failure's (``errno.ENOSPC`` for a full disk) where the file system refused it, else None."""

    def __init__(self, message: str, *, hint: str | None = None, errno: int | None = None) -> None:
        super().__init__(message, hint=hint)
        self.errno = errno  # not strerror too: str() would be '[Errno N] strerror' in place of the sentence

    def __reduce__(self) -> tuple:  # OSError's keeps errno out (a broadcast between ranks pickles the error)
        return type(self), self.args, {**self.__dict__, "errno": self.errno}


class ProfilingError(DistPlanError, ValueError):
    """The module or its data cannot be profiled as given (no parameters, no batches, ...)."""


class DataLoadingError(ProfilingError):
    """Reading batches from the user's data loader failed (missing download, broken dataset, ...)."""


def described(value: object) -> str:
    """``value`` as a message names what was given: "None", "a dict", "an int", and "an object of type Out" for a class
    whose name no article fits by rule (a user's ModelOutput, a UserDict)."""
    return "None" if value is None else described_type(type(value))


def described_type(kind: type) -> str:
    """What :func:`described` says of a value of type ``kind``."""
    name = kind.__name__
    if kind.__module__ == "builtins":
        return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
    return f"an object of type {name}"


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message, or its type's name when it has none (for one-line reports)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
