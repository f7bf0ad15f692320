"""The one spelling of a method with options, shared by compression methods and embedders.

`name` or `name:key=value:key=value`, e.g. `snapkv:window=64:budget=adaptive`,
`kv-embedding:layers=8-14:bias=1.0`. The CLI, the API and result files all use it.
"""

from __future__ import annotations

import inspect
import re

from kvmem.errors import KVMemError


def parse_spec(spec: str, known, kind: str = "method") -> tuple[str, dict]:
    """`spec` -> (name, options). Values: `a-b` is the integer range a..b, `a+b+c` a list of integers, then
    int, float, `true`/`false`, or the raw string. `known` are the valid names."""
    name, *parts = spec.strip().split(":")
    if name not in known:
        raise KVMemError(f"unknown {kind} {name!r}; choose from {', '.join(known)}")
    options: dict = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise KVMemError(f"bad option {part!r} in {kind} {spec!r}: write key=value")
        options[key] = option_value(value)
    return name, options


def option_value(value: str):
    if re.fullmatch(r"\d+-\d+", value):
        a, b = map(int, value.split("-"))
        if a > b:
            raise KVMemError(f"empty range {value!r}: write low-high, e.g. 8-14")
        return list(range(a, b + 1))
    if re.fullmatch(r"\d+(\+\d+)+", value):
        return [int(v) for v in value.split("+")]
    if value in ("true", "false"):
        return value == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def check_options(name: str, cls: type, options: dict, skip: tuple[str, ...] = ()) -> None:
    """Every option is a parameter of `cls.__init__`, and a number where the parameter's default is one."""
    params = {k: p for k, p in inspect.signature(cls.__init__).parameters.items() if k not in ("self", *skip)}
    if unknown := sorted(set(options) - set(params)):
        raise KVMemError(f"method {name!r} has no option {', '.join(unknown)}; its options: "
                         f"{', '.join(sorted(params)) or 'none'}")
    for key, value in options.items():
        default = params[key].default
        wanted = bool if type(default) is bool else int if type(default) is int else float if type(default) is float else None
        ok = {bool: lambda v: isinstance(v, bool), int: lambda v: isinstance(v, int) and not isinstance(v, bool),
              float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), None: lambda v: True}[wanted](value)
        if not ok:
            what = {bool: "true or false", int: "an integer", float: "a number"}[wanted]
            raise KVMemError(f"option {key} of {name!r} must be {what}, got {value!r}")


def format_spec(name: str, options: dict) -> str:
    """The canonical spelling: options sorted, as `parse_spec` reads them back."""
    def fmt(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list):
            return "+".join(map(str, v))
        return str(v)
    return ":".join([name] + [f"{k}={fmt(v)}" for k, v in sorted(options.items())])
