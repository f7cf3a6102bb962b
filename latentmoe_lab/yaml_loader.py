"""The one YAML reader of the project's config files (service files, ModelConfig YAML): a strict subset.

PyYAML's safe loader (no `!!python/...` constructor ever runs), narrowed to what a config needs:

    no anchors (&a) or aliases (*a)   an alias bomb of a few hundred bytes expands to gigabytes
                                      wherever the value is printed or walked
    no explicit tags (!!int, !!set, !!binary, ...)
    mapping keys: strings, each once  duplicates would silently keep the last value; `1:` or `null:`
                                      keys cannot name a field
    plain scalars read as YAML 1.2    ints are plain decimals only (`64`, `-3`; `1:04`, `010`, `0x40`,
                                      `1_000` stay strings, so an int field refuses them by name);
                                      floats need a dot or an exponent (`0.5`, `1e-6`, `.inf`);
                                      booleans are true / false only (`yes`, `on`, `no` stay strings);
                                      null is `null`, `~` or nothing; no timestamps
    ints of at most MAX_INT_DIGITS digits, nesting at most MAX_DEPTH deep, one document, not empty

Every refusal and every YAML error (syntax, tabs, NUL bytes, two documents, ...) is one ValueError line:
`<source>, line L, column C: <what>`. Files are read by textfile.read_text_file: a regular file of at
most 1 MiB, checked before reading (a FIFO or a 1 GB file is refused at once).
"""
from __future__ import annotations

import contextlib
import re

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import AliasEvent
from yaml.nodes import MappingNode
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import BaseResolver
from yaml.scanner import Scanner

try:
    from yaml.cyaml import CParser
except ImportError:  # PyYAML built without libyaml
    CParser = None

from latentmoe_lab.config_fields import ConfigTypeError, describe
from latentmoe_lab.textfile import read_text_file

MAX_DEPTH = 32  # configs nest 2-3 deep; the cap also keeps the composer far from Python's recursion limit
MAX_INT_DIGITS = 30  # past int64 and uint64 already: a longer int is a mistake, and costly to print


class _ConfigResolver(BaseResolver):
    """YAML 1.2 core-schema plain scalars, without octal / hex ints (see the module docstring)."""


for _tag, _pattern, _first in [
    ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("int", r"^[-+]?(?:0|[1-9][0-9]*)$", "-+0123456789"),
    ("float", r"^(?:[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*|[0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+"
              r"|\.[0-9]+[eE][-+]?[0-9]+)|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$", "-+.0123456789"),
    ("null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
]:
    _ConfigResolver.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(_pattern), list(_first))


class _StrictComposer(Composer):
    """Nodes without anchors, aliases or explicit tags, at most MAX_DEPTH deep."""

    depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, AliasEvent):
            raise _Refused(f"aliases (*{event.anchor}) are not allowed in a config file", event.start_mark)
        if event.anchor is not None:
            raise _Refused(f"anchors (&{event.anchor}) are not allowed in a config file", event.start_mark)
        if getattr(event, "tag", None) is not None:
            tag = event.tag.replace("tag:yaml.org,2002:", "!!")
            raise _Refused(f"explicit tags ({tag}) are not allowed in a config file", event.start_mark)
        if self.depth >= MAX_DEPTH:
            raise _Refused(f"nested more than {MAX_DEPTH} levels deep", event.start_mark)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


class _StrictConstructor(SafeConstructor):
    """Mappings with str keys, each once; ints of at most MAX_INT_DIGITS digits."""

    def construct_mapping(self, node, deep=False):
        if not isinstance(node, MappingNode):
            raise _Refused("expected a mapping", node.start_mark)
        mapping, first_seen = {}, {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):
                raise _Refused(f"mapping keys must be strings, got {describe(key)}", key_node.start_mark)
            if key in mapping:
                raise _Refused(f"duplicate key {describe(key)} (first at line {first_seen[key]})",
                               key_node.start_mark)
            first_seen[key] = key_node.start_mark.line + 1
            mapping[key] = self.construct_object(value_node, deep=deep)
        return mapping

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        if len(text.lstrip("+-")) > MAX_INT_DIGITS:
            raise _Refused(f"an integer of {len(text.lstrip('+-'))} digits; at most {MAX_INT_DIGITS}",
                           node.start_mark)
        return int(text)


_StrictConstructor.add_constructor("tag:yaml.org,2002:int", _StrictConstructor.construct_yaml_int)


class _PythonLoader(Reader, Scanner, Parser, _StrictComposer, _StrictConstructor, _ConfigResolver):
    def __init__(self, text: str):
        Reader.__init__(self, text)
        Scanner.__init__(self)
        Parser.__init__(self)
        _StrictComposer.__init__(self)
        _StrictConstructor.__init__(self)
        _ConfigResolver.__init__(self)


if CParser is not None:
    class _LibyamlLoader(_StrictComposer, CParser, _StrictConstructor, _ConfigResolver):
        """libyaml scans and parses (about 10x faster); the composing and constructing above stay in Python."""

        def __init__(self, text: str):
            CParser.__init__(self, text)
            _StrictComposer.__init__(self)
            _StrictConstructor.__init__(self)
            _ConfigResolver.__init__(self)



_LOADER = _PythonLoader if CParser is None else _LibyamlLoader


class _Refused(yaml.MarkedYAMLError):
    """Valid YAML outside the config subset; carries the position like PyYAML's own errors."""

    def __init__(self, problem: str, mark):
        super().__init__(problem=problem, problem_mark=mark)


def parse_yaml(text: str, source: str = "text", reference: bool = False):
    """One YAML document of the config subset -> Python data (dicts with str keys, lists, scalars).

    `source` names the text in errors (a file path, or "text"). Raises ValueError (one line) naming
    source, line and column; TypeError when `text` is not a str. reference=True scans and parses in
    pure Python (PyYAML's own scanner), the twin the libyaml path is tested against."""
    if not isinstance(text, str):
        raise TypeError(f"{source}: expected YAML text as a str, got {type(text).__name__}")
    bad = Reader.NON_PRINTABLE.search(text)  # before libyaml, which counts bytes and chokes on surrogates
    if bad is not None:
        line = text.count("\n", 0, bad.start()) + 1
        column = bad.start() - (text.rfind("\n", 0, bad.start()) + 1) + 1
        raise ValueError(f"{source}, line {line}, column {column}: not valid YAML: the character "
                         f"#x{ord(bad.group()):04x} is not allowed")
    loader = None
    try:
        loader = (_PythonLoader if reference else _LOADER)(text)
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as error:
        raise ValueError(_marked_message(source, error)) from None
    except yaml.YAMLError as error:
        raise ValueError(f"{source}: not valid YAML: {_one_line(str(error))}") from None
    finally:
        if loader is not None:
            loader.dispose()
    if data is None:
        raise ValueError(f"{source}: holds no YAML value (an empty file or only comments)")
    return data


def read_yaml_file(path, name: str = "path", hint: str = ""):
    """parse_yaml of the file at `path`, read by textfile.read_text_file (`name` and `hint` name the
    argument in its errors); errors in the text name the file."""
    text = read_text_file(path, name, hint=hint)
    return parse_yaml(text, source=file_label(path))


def dump_yaml(data) -> str:
    """YAML text of plain data that parse_yaml reads back equal: no anchors even when one object is
    shared, keys in the given order."""
    return yaml.dump(data, Dumper=_NoAliasDumper, sort_keys=False)


@contextlib.contextmanager
def errors_name_file(path):
    """Prefix the file to the ValueErrors (ConfigTypeError too) raised inside: `<file>: <key path>: ...`."""
    try:
        yield
    except ValueError as error:
        kind = ConfigTypeError if isinstance(error, TypeError) else ValueError
        raise kind(f"{file_label(path)}: {error}") from None


def file_label(path) -> str:
    """A file path as errors show it: as given, at most 200 characters."""
    text = str(path)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} chars)"


class _NoAliasDumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:
        return True


def _marked_message(source: str, error: yaml.MarkedYAMLError) -> str:
    mark = error.problem_mark or error.context_mark
    where = f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else source
    if isinstance(error, _Refused):
        return f"{where}: {error.problem}"
    what = ", ".join(part for part in (error.context, error.problem) if part)
    return f"{where}: not valid YAML: {_one_line(what)}"


def _one_line(text: str) -> str:
    return " ".join(text.split())
