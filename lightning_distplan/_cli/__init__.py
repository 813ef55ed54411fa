"""Subcommands of the ``distplan`` CLI, one module each (see ``lightning_distplan.cli``)."""
