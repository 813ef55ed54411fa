"""The ``distplan`` command: ``profile``, ``plan``, ``tune``, ``dashboard``, ``bench``.

Each subcommand lives in ``lightning_distplan/_cli/<name>.py`` and exposes
``add_parser(subparsers) -> None`` and ``run(args) -> int``. This module only dispatches and turns
user errors into one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from typing import NoReturn, Sequence

__all__ = ["main"]

_COMMANDS = ("profile", "plan", "tune", "dashboard", "bench")
# The commands that import torch and lightning; the others start in a fraction of the time.
_LIGHTNING_COMMANDS = ("profile", "bench")


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are one line with a HINT (argparse prints the whole usage first: a dozen
    lines before the sentence that matters). Subcommand parsers are made of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message.rstrip('.')}. HINT: See `{self.prog} --help` for the options.\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None) -> argparse.Namespace:  # type: ignore[override]
        # argparse reports a subcommand's unknown flag from the top parser ("distplan: error: unrecognized arguments:
        # --bandwith-gbps 3"), whose --help lists no subcommand's options: the subcommand's parser reports it here.
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            subcommands = getattr(self, "subcommands", {})
            target = subcommands.get(getattr(parsed, "command", None), self)
            target.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="distplan", description="Profile, plan and tune distributed training of a LightningModule.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    parser.subcommands = sub.choices  # type: ignore[attr-defined]  # name -> parser, for parse_args' unknown flags
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"lightning_distplan._cli.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"lightning_distplan._cli.{name}":
                continue  # subcommand not built yet
            raise
        module.add_parser(sub)
    return parser


def _short_warnings(command: str) -> None:
    """Our own warnings print as ``distplan <command>: warning: ...``, not with this package's source path and line
    (Lightning's format claims any path with "lightning" in it, ours included)."""
    import os
    import warnings

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    default = getattr(warnings.formatwarning, "distplan_fallback", warnings.formatwarning)  # main() may run again in-process

    def formatwarning(message, category, filename, lineno, line=None):  # type: ignore[no-untyped-def]
        if os.path.abspath(filename).startswith(package):
            return f"distplan {command}: warning: {message}\n"
        return default(message, category, filename, lineno, line)

    formatwarning.distplan_fallback = default  # type: ignore[attr-defined]
    warnings.formatwarning = formatwarning


def main(argv: Sequence[str] | None = None) -> int:
    # Starting imports torch and lightning (the parser imports the package; the console script defers the
    # strategies to _register_strategies below): seconds on a cold start, in which a Ctrl-C must end with one line.
    # The first Ctrl-C while torch and lightning are imported is only recorded and acted on once the imports are done:
    # a KeyboardInterrupt raised inside torch's native start-up can abort the interpreter (SIGABRT and a stack dump,
    # seen in CI), and a library may turn it into an error of its own (see _distplan_cli). A second one stops at once.
    interrupted: list[int] = []

    def on_sigint(signum: int, frame: object) -> None:
        interrupted.append(signum)
        if len(interrupted) > 1:
            raise KeyboardInterrupt

    previous = signal.getsignal(signal.SIGINT)
    ours = previous is signal.default_int_handler and threading.current_thread() is threading.main_thread()
    if ours:  # not where SIGINT is ignored (a background job) or handled by the caller
        signal.signal(signal.SIGINT, on_sigint)
    try:
        parser = _parser()
        args = parser.parse_args(argv)
        from lightning_distplan import _register_strategies
        from lightning_distplan.errors import DistPlanError

        if args.command in _LIGHTNING_COMMANDS:
            _register_strategies()  # the console script imported the package without (see _distplan_cli.starting)
        _short_warnings(args.command)  # after lightning's import, which installs a format of its own
        if interrupted:  # a library swallowed the KeyboardInterrupt (a broad except) and went on: the user still stopped it
            raise KeyboardInterrupt
    except BaseException as err:
        if interrupted or isinstance(err, KeyboardInterrupt):
            print("distplan: interrupted while starting; nothing was run", file=sys.stderr)
            return 130
        raise
    finally:
        if ours:
            signal.signal(signal.SIGINT, previous)

    try:
        return int(args.run(args) or 0)
    except DistPlanError as err:
        print(f"distplan {args.command}: error: {err}", file=sys.stderr)
        import os

        if os.environ.get("DISTPLAN_DEBUG"):  # the traceback, with the original error chained where there is one
            raise
        return 2
    except BrokenPipeError:
        # the reader of our output went away (`distplan plan ... | head`): end quietly, as a killed writer does
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout at exit
        return 141
    except (ValueError, TypeError, LookupError, ImportError, RuntimeError, OSError) as err:
        # KeyError's str() quotes its message; its first argument is the sentence.
        text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
        message = text.strip().splitlines()[0] if text.strip() else type(err).__name__
        if "HINT:" not in message:
            message += " HINT: run with --help for usage, or set DISTPLAN_DEBUG=1 for the traceback."
        print(f"distplan {args.command}: error: {type(err).__name__}: {message}", file=sys.stderr)
        import os

        if os.environ.get("DISTPLAN_DEBUG"):
            raise
        return 2
    except KeyboardInterrupt as err:
        what = {
            "tune": "; the study was left as it was",
            "profile": "; no profile was written",
            "bench": "; no result file was written",
        }.get(args.command, "")
        if err.args and isinstance(err.args[0], str):  # the command says what it kept
            what = "; " + err.args[0]
        print(f"distplan {args.command}: interrupted{what}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
