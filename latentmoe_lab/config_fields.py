"""Typed checks for the config dataclasses, read from their own field annotations.

One rule per annotation, so a field is checked the moment it is declared (docs/design.md §4: bad
configs raise an error naming the field):

    bool               True or False (not 0 / 1)
    int                an int, not a bool, within int64
    float              an int or float, finite (ints become floats); a string such as "1e-6" is refused
    str                a str of at most MAX_STRING_CHARS characters
    list[str]          a list or tuple of str
    a config class     an instance of it (dicts are converted before the check)
    X | None           None or X

Value rules (ranges, choices, agreement between keys) go through check / check_choice /
check_positive_int here, the one set every section uses.

Messages show values through describe(): at most MAX_SHOWN_CHARS characters, so a value nested
without bound is never walked whole, and an int of thousands of digits (which refuses to become a
string) is shown by its size.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import reprlib
import types
import typing

MAX_STRING_CHARS = 256
INT64_MAX = 2 ** 63 - 1
MAX_SHOWN_CHARS = 200  # of any value in an error message


class ConfigTypeError(TypeError, ValueError):
    """A config field holds the wrong type. A TypeError, and also a ValueError: every other config
    mistake is a ValueError, so code that catches ValueError around config loading sees this one too."""


def describe(value) -> str:
    """A short description of any value for an error message: at most MAX_SHOWN_CHARS characters, built
    without walking more than a few dozen elements (an alias bomb is never expanded, a huge int never
    converted to digits)."""
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if abs(value) < 10 ** 30 else f"an int of {value.bit_length()} bits"
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"{value[:40]!r}... ({len(value)} chars)"
    shown = f"{type(value).__name__} {_SHORT_REPR.repr(value)}"
    return shown if len(shown) <= MAX_SHOWN_CHARS else shown[:MAX_SHOWN_CHARS - 3] + "..."


def key_name(key) -> str:
    """A mapping key as a key path shows it: as written when a short string, else describe(key)."""
    return key if isinstance(key, str) and len(key) <= 60 and key.isprintable() else describe(key)


class _ShortRepr(reprlib.Repr):
    """reprlib's bounded repr, with ints described as describe() does (repr of a 5000-digit int raises)."""

    def repr_int(self, value, level):
        return describe(value)


_SHORT_REPR = _ShortRepr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxstring, _SHORT_REPR.maxother = 3, 40, 40
_SHORT_REPR.maxlist = _SHORT_REPR.maxtuple = _SHORT_REPR.maxdict = _SHORT_REPR.maxset = 4


def check(ok: bool, path: str, rule: str) -> None:
    """The one value check of every config section: ValueError "<path>: <rule>" unless `ok`."""
    if not ok:
        raise ValueError(f"{path}: {rule}")


def check_choice(path: str, value, choices: tuple[str, ...]) -> None:
    check(value in choices, path, f"must be one of {list(choices)}, got {describe(value)}")


def check_positive_int(path: str, value: int) -> None:
    check(value >= 1, path, f"must be a positive integer, got {describe(value)}")


def section_from_dict(section_cls, values: dict, path: str):
    """The config section `section_cls` of a mapping from a file, an unknown key named by its `path`
    ("memory.offload.hot_rows: unknown key; expected some of [...]"); types and ranges are checked after."""
    known = [f.name for f in dataclasses.fields(section_cls)]
    for key in values:
        if key not in known:
            raise ValueError(f"{path}.{key_name(key)}: unknown key; expected some of {known}")
    return section_cls(**values)


def check_field_types(obj, prefix: str = "") -> None:
    """Check every field of the dataclass instance `obj` against its annotation; ints in float
    fields become floats. Raises ConfigTypeError / ValueError naming `<prefix><field>`."""
    hints = _type_hints(type(obj))
    for f in dataclasses.fields(obj):
        name = prefix + f.name
        value = getattr(obj, f.name)
        setattr(obj, f.name, _checked(value, hints[f.name], name))


@functools.cache
def _type_hints(cls) -> dict:
    return typing.get_type_hints(cls)  # the annotations are strings (from __future__ import annotations)


def _checked(value, hint, name: str):
    options = _union_members(hint)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigTypeError(f"{name}: must not be None (expected {_spell(options)})")
    kinds = [t for t in options if t is not type(None)]
    for kind in kinds:
        if _matches(value, kind):
            return _normalised(value, kind, name)
    hint_text = ""
    if isinstance(value, str) and float in kinds:
        hint_text = " (a number written as a string)"
    raise ConfigTypeError(f"{name}: expected {_spell(options)}, got {describe(value)}{hint_text}")


def _union_members(hint) -> tuple:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _matches(value, kind) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    if typing.get_origin(kind) is list:
        return isinstance(value, (list, tuple))
    return isinstance(value, kind)


def _normalised(value, kind, name: str):
    if kind is int and abs(value) > INT64_MAX:
        raise ValueError(f"{name}: must fit in int64, got {describe(value)}")
    if kind is float:
        value = float(value) if abs(value) < 2 ** 1000 else math.inf
        if not math.isfinite(value):
            raise ValueError(f"{name}: must be a finite number, got {describe(value)}")
    if kind is str and len(value) > MAX_STRING_CHARS:
        raise ValueError(f"{name}: must be at most {MAX_STRING_CHARS} characters, got {describe(value)}")
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        value = [_checked(entry, item, f"{name}[{i}]") for i, entry in enumerate(value)]
    return value


def _spell(options: tuple) -> str:
    names = []
    for kind in options:
        if kind is type(None):
            names.append("None")
        elif typing.get_origin(kind) is list:
            names.append(f"a list of {typing.get_args(kind)[0].__name__}")
        else:
            names.append(kind.__name__)
    return " or ".join(names)
