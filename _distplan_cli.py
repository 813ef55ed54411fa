"""The ``distplan`` console script's entry point, outside the package.

Importing ``lightning_distplan`` imports torch and lightning (it registers the strategies), which
takes seconds on a cold start; a Ctrl-C there lands before ``lightning_distplan.cli.main`` could
catch it. This module imports nothing heavy itself, so it can turn that Ctrl-C into one line.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from lightning_distplan.cli import main as run
    except KeyboardInterrupt:
        print("distplan: interrupted while starting; nothing was run", file=sys.stderr)
        return 130
    return run()


if __name__ == "__main__":
    sys.exit(main())
