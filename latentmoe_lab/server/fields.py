"""One request field -> a checked Python value, or a 400 APIError naming the field and the rule (docs/design.md §10).

The JSON parser gives arbitrary-precision integers, floats that may be inf, and strings that may hold
lone surrogates (a "\\ud800" escape); each reader here refuses what the engine could not take.
"""
from __future__ import annotations

import math

from latentmoe_lab.server.errors import bad_request


def integer(body: dict, name: str, default, minimum: int, maximum: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name}: expected an integer, got {json_type(value)}", name, "invalid_type")
    if value < minimum or (maximum is not None and value > maximum):
        rule = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise bad_request(f"{name}: must be {rule}, got {_short(value)}", name)
    return value


def number(body: dict, name: str, default: float, low: float, high: float | None = None) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{name}: expected a number, got {json_type(value)}", name, "invalid_type")
    value = float(value) if abs(value) < 1e308 else math.inf  # an integer too large for a float
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        rule = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]"
        raise bad_request(f"{name}: must be a finite number {rule}, got {value:g}", name)
    return value


def boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name}: expected true or false, got {json_type(value)}", name, "invalid_type")
    return value


def text(value: str, where: str) -> str:
    """A string that encodes as UTF-8 (no lone surrogates), else 400 naming `where`."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise bad_request(f"{where}: not valid Unicode text (a lone surrogate at character {error.start})", where,
                          "invalid_text") from None
    return value


def json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _short(value: int) -> str:
    """An integer for a message: a 5000-digit one is not printed whole."""
    return str(value) if abs(value) < 10**30 else f"an integer of {len(str(abs(value)))} digits"
