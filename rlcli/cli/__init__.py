"""Typer apps, one module per command: parse, lazy-import, run()."""
