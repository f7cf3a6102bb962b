"""Every command and snippet in README.md runs as written.

- Every command of a ```bash block is one of the forms checked here: a `make` target that exists, a
  `latentmoe-lab` command (or `-m latentmoe_lab ...` under torchrun / accelerate) whose flags the real parser
  accepts, or the `lm_eval` call with task files that exist. A form not listed fails the test, so a new
  kind of command in the README gets a check here too.
- The cheap ones run and must exit 0: `--help`, `info`, `plan-service` and the simulated-device `align`.
  Servers, training runs and `make` targets take minutes or run until stopped; their flags are checked.
- Every ```python block uses only names it defines or imports, or that an earlier block defined (a reader
  runs them top to bottom), and the quick start's blocks run.
tests/test_readme_script.py runs the serving-engine snippet itself.
"""
import ast
import builtins
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from latentmoe_lab.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CHEAP = ("--help", "info", "plan-service", "align")  # run in full: a few seconds each
LAUNCHED_MODULES = {"latentmoe_lab.parallel": ["parallel"], "latentmoe_lab": []}


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def _commands() -> list[str]:
    """Each command of the bash blocks: continuation lines joined, comments and blank lines dropped."""
    commands = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


COMMANDS = _commands()


def _without_env_and_redirect(words: list[str]) -> list[str]:
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    return words[:words.index(">")] if ">" in words else words


def _latentmoe_argv(words: list[str]) -> list[str] | None:
    """The `latentmoe-lab` arguments of a command, or None when it is not one."""
    if words[0] == "latentmoe-lab":
        return words[1:]
    if words[0] in ("torchrun", "accelerate") and "-m" in words:
        module = words[words.index("-m") + 1]
        return [*LAUNCHED_MODULES[module], *words[words.index("-m") + 2:]]
    return None


def _check_lm_eval(words: list[str]) -> None:
    args = dict(zip(words[1::2], words[2::2]))
    include = ROOT / args["--include_path"]
    defined = {m for path in include.glob("*.yaml") for m in re.findall(r"^task: (\S+)", path.read_text(), re.M)}
    assert args["--model"] in ("local-completions", "local-chat-completions")
    assert set(args["--tasks"].split(",")) <= defined, (args["--tasks"], defined)
    for path in include.glob("*.yaml"):  # the data files the tasks read, relative to the repository root
        for data in re.findall(r"^\s+test: (\S+)", path.read_text(), re.M):
            assert (ROOT / data).is_file(), data


def test_the_readme_has_the_commands_of_a_guide():
    assert len(COMMANDS) > 30
    assert any(c.startswith("make demo") for c in COMMANDS) and any("lm_eval" in c for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_is_a_known_form_with_accepted_flags(command, capsys):
    words = _without_env_and_redirect(shlex.split(command))
    if words[0] == "make":
        targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
        assert set(w for w in words[1:] if "=" not in w) <= targets, command
        return
    if words[0] == "lm_eval":
        _check_lm_eval(words)
        return
    argv = _latentmoe_argv(words)
    assert argv is not None, f"README command of a form this test does not check: {command}"
    if argv == ["--help"]:
        return  # runs below
    try:
        build_parser([argv[0]]).parse_args(argv)
    except SystemExit as error:
        pytest.fail(f"{command}: the parser refused it (exit {error.code}): {capsys.readouterr().err}")


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.startswith("latentmoe-lab") and
                                     c.split()[1] in CHEAP and "--checkpoint" not in c])
def test_cheap_commands_run(command, tmp_path):
    words = [*shlex.split(command), *(["--report", str(tmp_path / "a.html")] if " align " in command else [])]
    done = subprocess.run([sys.executable, "-m", "latentmoe_lab", *words[1:]], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, (command, done.stderr[-2000:])
    assert done.stdout.strip()


def _free_names(code: str) -> set[str]:
    """Names a block reads without binding them itself (imports, assignments, loops, with, comprehensions)."""
    tree = ast.parse(code)
    bound, loaded = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return loaded - bound - set(dir(builtins))


def test_every_python_block_defines_what_it_uses():
    defined, missing = set(), {}
    for block in _blocks("python"):
        free = _free_names(block) - defined
        if free:
            missing[block.splitlines()[0]] = sorted(free)
        defined |= {n.id for n in ast.walk(ast.parse(block)) if isinstance(n, ast.Name)} | {
            (a.asname or a.name).split(".")[0] for n in ast.walk(ast.parse(block))
            if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert not missing, missing


def test_the_quick_start_blocks_run(tmp_path):
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    code = "\n".join(re.findall(r"```python\n(.*?)```", quick_start, flags=re.S))
    assert "LatentMoEForCausalLM(cfg)" in code and "ImageTextProcessor" in code
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_every_link_to_a_section_or_a_file_resolves():
    """(#anchor) links name a heading (GitHub's rule: lower case, punctuation dropped, spaces to hyphens);
    relative links name a file of the repository."""
    anchors = {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
               for heading in re.findall(r"^#{1,4} (.+)$", README, flags=re.M)}
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    assert links
    for link in links:
        if link.startswith("#"):
            assert link[1:] in anchors, link
        elif not link.startswith("http"):
            assert (ROOT / link).exists(), link
