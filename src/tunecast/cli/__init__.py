"""The command line: parse, call the library, render. The only place that prints or exits."""

from tunecast.cli.app import app, main

__all__ = ["app", "main"]
