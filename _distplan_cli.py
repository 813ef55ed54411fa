"""The ``distplan`` console script's entry point, outside the package.

Importing ``lightning_distplan`` imports torch and lightning (it registers the strategies), which
takes seconds on a cold start; a Ctrl-C there lands before ``lightning_distplan.cli.main`` could
catch it. This module imports nothing heavy itself, so it can turn that Ctrl-C into one line.
"""

from __future__ import annotations

import signal
import sys

#: True while :func:`main` imports the package: ``lightning_distplan/__init__.py`` then leaves the
#: strategies unregistered (that imports torch and lightning), and ``lightning_distplan.cli.main``
#: registers them for the commands that run Lightning.
starting = False


def main() -> int:
    global starting
    interrupted: list[int] = []

    def on_sigint(signum: int, frame: object) -> None:
        interrupted.append(signum)
        raise KeyboardInterrupt

    # A library being imported may turn the KeyboardInterrupt into an error of its own (matplotlib builds its
    # colormaps under a broad except): the flag says the user stopped it either way.
    previous = signal.signal(signal.SIGINT, on_sigint)
    starting = True
    try:
        from lightning_distplan.cli import main as run

        if interrupted:  # a library swallowed the KeyboardInterrupt (a broad except) and the import went on
            raise KeyboardInterrupt
    except BaseException:
        if interrupted:
            print("distplan: interrupted while starting; nothing was run", file=sys.stderr)
            return 130
        raise
    finally:
        starting = False
        signal.signal(signal.SIGINT, previous)
    return run()


if __name__ == "__main__":
    # Run as a file (python _distplan_cli.py ...) this module is __main__, and lightning_distplan looks for the
    # `starting` flag on the module named _distplan_cli: without this it imported torch and lightning for every command.
    sys.modules.setdefault("_distplan_cli", sys.modules[__name__])
    sys.exit(main())
