"""Decoding methods. A method runs one round for every slot: it lays out tokens, asks the engine
for forwards, lets the shared verifier accept, and says how many tokens each row commits.
Methods never touch the KV cache or the model directly."""
from __future__ import annotations

import inspect

from fastspec.config import FastspecError
from fastspec.methods.base import Method, RoundOutput
from fastspec.methods.ar import AR
from fastspec.methods.bastion import BASTION
from fastspec.methods.d2sd import D2SD
from fastspec.methods.dflash import DFlash
from fastspec.methods.libraspec import LibraSpec
from fastspec.methods.linear import LinearSS
from fastspec.methods.recguide import RecGuide
from fastspec.methods.tidar import TiDAR

METHODS: dict[str, type[Method]] = {"ar": AR, "linear": LinearSS, "recguide": RecGuide,
                                     "d2sd": D2SD, "dflash": DFlash, "libraspec": LibraSpec,
                                     "tidar": TiDAR, "bastion": BASTION}


# Short option names a method spec may use: `recguide[corr=1;cont=0;blocks=8/16/32]`.
ALIASES = {"corr": "max_corrections", "cont": "continuation", "t": "threshold",
           "signal": "use_signal", "stratum": "use_stratum"}


def parse_method_spec(spec: str) -> tuple[str, dict]:
    """`name[key=value;key=value]` -> (name, options). Values: ints, floats, 0/1 for flags,
    `8/16/32` for tuples of ints, strings otherwise (a path keeps its slashes)."""
    spec = spec.strip()
    if "[" not in spec:
        return spec, {}
    if not spec.endswith("]"):
        raise FastspecError(f"method spec {spec!r}: options go in brackets, name[key=value;...]")
    name, body = spec[:-1].split("[", 1)
    options = {}
    for item in filter(None, (x.strip() for x in body.split(";"))):
        key, eq, value = item.partition("=")
        if not eq:
            raise FastspecError(f"method spec {spec!r}: {item!r} is not key=value")
        key = ALIASES.get(key.strip(), key.strip())
        value = value.strip()
        parts = value.split("/")
        if len(parts) > 1 and all(v.strip().isdigit() for v in parts):
            options[key] = tuple(int(v) for v in parts)       # 8/16/32
        elif "/" in value:
            options[key] = value                              # a path (tables=profiles/x.json)
        else:
            for cast in (int, float):
                try:
                    value = cast(value)
                    break
                except ValueError:
                    pass
            options[key] = value
    return name.strip(), options


def get_method(name: str | Method, **options) -> Method:
    if isinstance(name, Method):
        return name
    name, spec_options = parse_method_spec(name)
    if name not in METHODS:
        raise FastspecError(f"unknown method {name!r} (available: {', '.join(METHODS)})")
    cls = METHODS[name]
    known = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = [k for k in spec_options if k not in known]
    if unknown:
        raise FastspecError(f"method {name!r} has no option {unknown[0]!r} (options: {', '.join(known)})")
    try:
        return cls(**{**options, **spec_options})
    except TypeError as e:
        raise FastspecError(f"method {name!r}: {e}") from None


__all__ = ["METHODS", "Method", "RoundOutput", "get_method", "parse_method_spec"]
