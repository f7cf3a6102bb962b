"""The repository documents itself: docs/design.md exists with the section numbers the code cites,
every "docs/design.md §N.M" citation resolves, nothing points outside the repository, and the
LICENSE that pyproject declares is there."""
import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
OUTSIDE = ("../" + "shared", "shared/" + "DESIGN", "/work/" + "shared")  # split so this file does not match itself
CITATION = re.compile(r"docs/design\.md,? §(\d+(?:\.\d+)?)")


def _repository_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in listed if (ROOT / f).is_file()]


def _texts():
    for path in _repository_files():
        try:
            yield path, path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary files (images) cite nothing


def _sections() -> set[str]:
    heads = re.findall(r"^#{2,3} (\d+(?:\.\d+)?)[. ]", DESIGN.read_text(encoding="utf-8"), flags=re.M)
    return set(heads)


def test_design_doc_has_the_numbered_sections():
    sections = _sections()
    expected = {str(n) for n in range(1, 11)} | {f"1.{i}" for i in range(1, 7)} | {f"6.{i}" for i in range(1, 7)}
    assert expected <= sections


def test_nothing_references_files_outside_the_repository():
    offenders = [f"{path.relative_to(ROOT)}: {needle}" for path, text in _texts() for needle in OUTSIDE
                 if needle in text and path != Path(__file__).resolve()]
    assert not offenders, offenders


def test_every_design_citation_resolves():
    sections = _sections()
    cited = {(path.relative_to(ROOT).as_posix(), number) for path, text in _texts()
             for number in CITATION.findall(text)}
    assert len(cited) > 20  # the code, notebooks and tests do cite it
    dangling = sorted(c for c in cited if c[1] not in sections)
    assert not dangling, dangling
    bare = [str(path.relative_to(ROOT)) for path, text in _texts() if re.search(r"\bDESIGN(\.md)? \d", text)]
    assert not bare, bare


def test_license_matches_pyproject():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert declared in ({"text": "Apache-2.0"}, "Apache-2.0")
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 190
