"""Decoding methods. A method runs one round for every slot: it lays out tokens, asks the engine
for forwards, lets the shared verifier accept, and says how many tokens each row commits.
Methods never touch the KV cache or the model directly."""
from __future__ import annotations

from fastspec.config import FastspecError
from fastspec.methods.base import Method, RoundOutput
from fastspec.methods.ar import AR
from fastspec.methods.linear import LinearSS
from fastspec.methods.recguide import RecGuide

METHODS: dict[str, type[Method]] = {"ar": AR, "linear": LinearSS, "recguide": RecGuide}


def get_method(name: str | Method, **options) -> Method:
    if isinstance(name, Method):
        return name
    if name not in METHODS:
        raise FastspecError(f"unknown method {name!r} (available: {', '.join(METHODS)})")
    return METHODS[name](**options)


__all__ = ["METHODS", "Method", "RoundOutput", "get_method"]
