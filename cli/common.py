"""What every fastspec command shares: user errors become one line and a non-zero exit."""
from __future__ import annotations

import functools
import sys

from rich.console import Console

from fastspec.config import FastspecError

# Piped output (CI logs, files) gets wide tables instead of 80 columns of ellipses.
console = Console(stderr=False, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def user_errors(fn=None, *, interrupted: str = "interrupted"):
    """Turn expected failures into one clear line and a non-zero exit, never a traceback."""
    if fn is None:
        return functools.partial(user_errors, interrupted=interrupted)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FastspecError as e:
            err_console.print(f"[bold red]error:[/] {e}", highlight=False)
            sys.exit(1)
        except KeyboardInterrupt:
            err_console.print(interrupted, highlight=False)
            sys.exit(130)
    return wrapper
