"""Seeded fuzz of the shipped service files through what `serve` and `plan-service` run (docs/design.md §6.1).

Each case mutates one of configs/service-cpu.yaml, service-cpu-ep2tp2.yaml or service-example.yaml, then
runs load_service_file (serve's loader) and, when it loads, service_plan_text (plan-service). Allowed
outcomes: the plan, or a one-line ValueError / TypeError. Not allowed: any other exception (a traceback
in the CLI), a case that runs past CASE_LIMIT_S (a hang), and a mutation known to be nonsense (an alias,
a duplicate key, a collapsed section, a YAML 1.1 int, a size this host cannot serve, ...) that loads.
"""
import random
import re
import signal
from dataclasses import fields
from pathlib import Path

import pytest

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.server.settings import ServerSettings, load_service_file
from latentmoe_lab.serving.config import MemorySection, ModelSection, ParallelSection, SchedulerSection
from latentmoe_lab.serving.service_plan import service_plan_text

CONFIGS = Path(__file__).parents[1] / "configs"
FILES = ["service-cpu.yaml", "service-cpu-ep2tp2.yaml", "service-example.yaml"]
CASES_PER_FILE = 100
CASE_LIMIT_S = 10  # a case takes milliseconds; this only turns a hang into a failure
BOMB = "[&a [x, x, x, x, x, x, x, x, x], &b [*a, *a, *a, *a, *a, *a, *a, *a, *a], " + ", ".join(
    f"&{name} [" + ", ".join([f"*{prev}"] * 9) + "]" for prev, name in zip("bcdefgh", "cdefghi")) + "]"

# values a key may be given, and those that are nonsense whatever the key: no field takes them
VALUES = ["''", "0", "false", "[]", "{}", "null", "-1", "1:04", "010", "0x40", "1_000", "1e400", ".nan",
          "18446744073709551616", "1000000000000", "x" * 300, "yes", "on", BOMB, "*undefined",
          "!!python/object/apply:os.system ['true']", "[1, [2, [3]]]", "{a: 1}", "9" * 5000, "'\u00e9\u4e2d'",
          "1.5", "&anchor 64", "!!int 64"]
ALWAYS_NONSENSE = {"''", "[]", "{}", "x" * 300, BOMB, "*undefined", "!!python/object/apply:os.system ['true']",
                   "[1, [2, [3]]]", "{a: 1}", "9" * 5000, "&anchor 64", "!!int 64"}
SECTION_CLASSES = [ModelSection, ParallelSection, MemorySection, SchedulerSection, ServerSettings]
INT_KEYS = {f.name for cls in SECTION_CLASSES for f in fields(cls) if str(f.type).startswith("int")}
BOOL_KEYS = {f.name for cls in SECTION_CLASSES for f in fields(cls) if f.type == "bool"}
JUNK = ["[", "{", ":", "\t", "\0", "&a ", "*a", "\n---\n", "%", "!", '"', "'", "? ", "- ", "\x07", "\ufeff", "#"]
SECTIONS = ["model", "parallel", "memory", "scheduler"]


def _mutate(text: str, rng: random.Random) -> tuple[str, str, bool]:
    """(mutated text, what was done, True when the result is nonsense that must be refused)."""
    lines = text.splitlines()
    keyed = [i for i, line in enumerate(lines) if re.match(r"\s+\w+:\s*\S", line)]
    kind = rng.choice(["value", "value", "value", "section", "duplicate", "delete", "junk", "indent", "rename",
                       "document", "host"])
    if kind == "value" and keyed:
        i = rng.choice(keyed)
        value = rng.choice(VALUES)
        key = lines[i].split(":")[0]
        lines[i] = f"{key}: {value}"
        return "\n".join(lines) + "\n", f"{key.strip()} = {value[:40]}", _nonsense(key.strip(), value)
    if kind == "section":
        section, value = rng.choice(SECTIONS), rng.choice(["''", "0", "false", "[]", "'x'", "1.5"])
        return _collapse(text, section, value), f"{section}: {value}", True
    if kind == "duplicate" and keyed:
        i = rng.choice(keyed)
        lines.insert(i + 1, lines[i])
        return "\n".join(lines) + "\n", f"line {i + 1} twice", True
    if kind == "delete":
        i = rng.randrange(len(lines))
        del lines[i]
        return "\n".join(lines) + "\n", f"line {i + 1} deleted", False
    if kind == "junk":
        at = rng.randrange(len(text) + 1)
        junk = rng.choice(JUNK)
        return text[:at] + junk + text[at:], f"{junk!r} at {at}", False
    if kind == "indent" and keyed:
        i = rng.choice(keyed)
        lines[i] = rng.choice(["", "    ", "\t"]) + lines[i].lstrip()
        return "\n".join(lines) + "\n", f"line {i + 1} re-indented", False
    if kind == "rename" and keyed:
        i = rng.choice(keyed)
        lines[i] = re.sub(r"(\w+):", lambda m: m.group(1)[::-1] + "x:", lines[i], count=1)
        return "\n".join(lines) + "\n", f"line {i + 1} key misspelt", True
    if kind == "document":
        extra = rng.choice(["---\nmodel: {}\n", "model: {}\n", "server: {max_retries: 1}\nserver: {}\n",
                            "extra: {a: 1}\n", "1: a\nnull: b\n"])
        return text + extra, f"appended {extra!r}", True
    key, value = rng.choice([("cache_bytes", str(1 << 50)), ("forward_threads", "1000000"),
                             ("group_timeout_s", "0.001"), ("max_log_records", str(10 ** 12)),
                             ("seed", str(1 << 64)), ("seed", "-5"), ("max_model_len", "1"), ("name", "''"),
                             ("expert_parallel_size", str(10 ** 12))])
    section = {"cache_bytes": "memory", "forward_threads": "parallel", "group_timeout_s": "parallel",
               "max_log_records": "scheduler", "expert_parallel_size": "parallel"}.get(key, "model")
    return _set_key(text, section, key, value), f"{section}.{key} = {value}", True


def _nonsense(key: str, value: str) -> bool:
    """An int key takes plain decimals (or null), a bool key true / false (or null): YAML 1.1's `1:04`,
    `010`, `0x40`, `1_000`, `yes` and `on` mean something else, or nothing, to a reader."""
    if value in ALWAYS_NONSENSE:
        return True
    if key in INT_KEYS:
        return not re.fullmatch(r"-?[0-9]+|null", value)
    if key in BOOL_KEYS:
        return value not in ("false", "null")
    return False


def _collapse(text: str, section: str, value: str) -> str:
    """The section's block (header + indented lines, or a one-line flow mapping) replaced by `section: value`."""
    out, skipping = [], False
    for line in text.splitlines():
        if line.startswith(f"{section}:"):
            out.append(f"{section}: {value}")
            skipping = True
        elif skipping and (line.startswith(" ") or not line.strip()):
            continue
        else:
            skipping = False
            out.append(line)
    return "\n".join(out) + "\n"


def _set_key(text: str, section: str, key: str, value: str) -> str:
    """`section.key: value` in a block-style or flow-style file (a key set twice would be another test)."""
    kept = [line for line in text.splitlines() if not re.match(rf"\s+{key}:", line)]
    flow = [i for i, line in enumerate(kept) if line.startswith(f"{section}:") and "{" in line]
    if flow:
        i = flow[0]
        kept[i] = re.sub(rf"\b{key}: [^,}}]*(, )?", "", kept[i]).replace("{", f"{{{key}: {value}, ", 1)
        return "\n".join(kept) + "\n"
    body = [i for i, line in enumerate(kept) if line.startswith(f"{section}:")]
    if not body:
        return "\n".join(kept) + f"\n{section}:\n  {key}: {value}\n"
    kept.insert(body[0] + 1, f"  {key}: {value}")
    return "\n".join(kept) + "\n"


class _Hang(Exception):
    pass


def _raise_hang(signum, frame):
    raise _Hang()


def _run(path: Path) -> str | None:
    """None when the file loads and plans; else the one-line error (ValueError / TypeError family)."""
    try:
        config, _ = load_service_file(path)
        service_plan_text(config, ModelConfig.from_preset(config.model.preset or "k3-2.8t"))
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


@pytest.mark.parametrize("name", FILES)
def test_mutated_service_files_load_plan_or_fail_in_one_line(name, tmp_path):
    base = (CONFIGS / name).read_text()
    assert _run(CONFIGS / name) is None  # the unmutated file loads and plans
    rng = random.Random(f"fuzz-{name}")
    previous = signal.signal(signal.SIGALRM, _raise_hang)
    refused = wrongly_accepted = 0
    try:
        for case in range(CASES_PER_FILE):
            text, what, nonsense = _mutate(base, rng)
            path = tmp_path / f"case{case}.yaml"
            path.write_text(text, encoding="utf-8")
            signal.alarm(CASE_LIMIT_S)
            try:
                error = _run(path)
            except _Hang:
                pytest.fail(f"case {case} ({what}): no answer within {CASE_LIMIT_S} s")
            finally:
                signal.alarm(0)
            if error is None:
                wrongly_accepted += nonsense
                assert not nonsense, f"case {case} ({what}): nonsense accepted"
                continue
            refused += 1
            assert "\n" not in error and len(error) < 700, f"case {case} ({what}): {error[:300]!r}"
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert refused >= CASES_PER_FILE // 2 and wrongly_accepted == 0  # most mutations break the file
