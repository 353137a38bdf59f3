"""Subcommands of the ``avest`` command line, one module each."""
