"""Where fastspec keeps its files, and the one way it writes a JSON result."""
from __future__ import annotations

import json
import os
from pathlib import Path

from fastspec.config import FastspecError


def cache_dir() -> Path:
    """Root of fastspec's cache: $FASTSPEC_CACHE, else ~/.cache/fastspec (models/, inductor/,
    extensions/, train/ ... live under it)."""
    return Path(os.environ.get("FASTSPEC_CACHE") or Path.home() / ".cache" / "fastspec")


def write_json(path: str | os.PathLike, obj, indent: int = 1) -> str:
    """Write obj as JSON atomically: a temp file beside `path`, then a rename. A reader (or a
    Ctrl-C) never sees half a file: `path` holds the previous complete version or the new one."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=indent)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def check_writable(path: str, flag: str) -> None:
    """A results path whose folder cannot be made or written fails now, not after the runs."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise FastspecError(f"{flag} {path}: cannot create its folder ({e.strerror})") from None
    if not os.access(folder, os.W_OK) or os.path.isdir(path):
        raise FastspecError(f"{flag} {path}: cannot write there")
