"""Check that exported pages stand alone, and take headless-browser screenshots of them to look at.

    python tools/check_exports.py                # -> reports/exports-check/*.html, *.png
    python tools/check_exports.py --skip-reports # only the notebooks (the committed .ipynb outputs)

It writes the reports a newcomer opens first (smoke, serve-bench, align; small runs), exports notebooks
01, 02 and 07 with latentmoe_lab.viz.export (formulas as MathML, no CDN script), checks every page for
scripts fetched from the network, raw TeX and widget cells without a figure, then opens each page in
headless Chromium with every request outside this machine refused (a proxy that does not exist) and
saves screenshots: the top of each report, and in the notebooks the sections with formulas, the widget
explorers and notebook 02's first animated figure. Look at the PNGs: the checks above cannot see layout.
Needs a Chromium binary (`apt-get install chromium`); without one it checks the pages and says so.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "latentmoe_lab"]
NOTEBOOKS = {  # notebook -> (heading words of the sections to screenshot)
    "01_routing": ("Router math", "Latent trade-off"),
    "02_hybrid_attention": ("one token at a time", "Explorer"),
    "07_quantization_and_alignment": ("The reference",),
}
REMOTE_SCRIPT = re.compile(r"<script[^>]*\bsrc=[\"']?https?://", re.IGNORECASE)


def write_reports(out: Path) -> list[Path]:
    """Small runs of the commands whose reports the outside trial looked at."""
    runs = {
        "smoke.html": ["smoke", "--repeats", "1", "--new-tokens", "4"],
        "serve.html": ["serve-bench", "--config", "configs/service-cpu.yaml", "--requests", "6", "--rate", "50",
                       "--max-prompt", "48", "--max-tokens", "8"],
        "align.html": ["align", "--candidate", "bf16", "--seq-len", "32"],
        "align-engine.html": ["align", "--candidate", "engine", "--seq-len", "32"],  # no routing flips
    }
    written = []
    for name, argv in runs.items():
        path = out / name
        print(f"writing {path} ...", flush=True)
        subprocess.run([*CLI, *argv, "--report", str(path)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        written.append(path)
    return written


def export_notebooks(out: Path) -> list[Path]:
    from latentmoe_lab.viz.export import export_notebook

    return [export_notebook(ROOT / "notebooks" / f"{name}.ipynb", out) for name in NOTEBOOKS]


def problems(page: Path) -> list[str]:
    """What keeps a page from standing alone, found in its HTML."""
    text = page.read_text(encoding="utf-8")
    found = []
    if REMOTE_SCRIPT.search(text):
        found.append("loads a script from the network")
    if page.stem in NOTEBOOKS:
        prose = re.sub(r"<(script|style|pre|code)\b.*?</\1>", "", text, flags=re.DOTALL | re.IGNORECASE)
        tex = re.findall(r"(?<![\\$])\$(?!\s)[^$<>\n]{1,80}(?<!\s)\$", prose)
        if tex:
            found.append(f"raw TeX left: {tex[:3]}")
        found += [f"widget cell {n} leaves no figure" for n in widget_cells_without_figure(page.stem)]
    return found


def widget_cells_without_figure(name: str) -> list[int]:
    """Code cells (1-based) of notebooks/<name>.ipynb that use ipywidgets but saved no plotly figure:
    an exported page would show them empty."""
    import nbformat

    notebook = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    return [n for n, cell in enumerate(cells, start=1) if "ipywidgets." in cell.source and not any(
        "application/vnd.plotly.v1+json" in output.get("data", {}) for output in cell.get("outputs", []))]


def chromium() -> str | None:
    return next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)


def screenshot(browser: str, page: Path, png: Path, anchor: str = "", height: int = 2400) -> None:
    """The page as Chromium draws it with no network (requests go to a closed port). With `anchor`, the
    cells before the one holding the element with that id are removed first, so the section is on top
    (headless screenshots show the top of the page; scrolling there is not reliably painted)."""
    shown = page
    if anchor:
        shown = page.with_name(f".{page.stem}-from-section.html")
        shown.write_text(page.read_text(encoding="utf-8") + f"<script>let cell = document.getElementById({anchor!r})"
                         ".closest('.jp-Cell'); while (cell.previousElementSibling) "
                         "cell.previousElementSibling.remove();</script>", encoding="utf-8")
    try:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
                        f"--window-size=1200,{height}", "--virtual-time-budget=8000", f"--screenshot={png}",
                        shown.resolve().as_uri()], check=True, capture_output=True, timeout=180)
    finally:
        if shown != page:
            shown.unlink()
    print(f"screenshot: {png}")


def anchors(page: Path, words: tuple[str, ...]) -> list[tuple[str, str]]:
    """(heading id, words) of the headings that contain each of `words` (nbconvert gives headings ids)."""
    ids = re.findall(r"<h[1-3] id=\"([^\"]+)\"", page.read_text(encoding="utf-8"))
    chosen = []
    for word in words:
        match = next((i for i in ids if word.lower().replace(" ", "-") in i.lower()), None)
        if match is None:
            raise SystemExit(f"{page.name}: no heading with {word!r} (headings: {ids})")
        chosen.append((match, word))
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "reports" / "exports-check"), help="output folder")
    parser.add_argument("--skip-reports", action="store_true", help="only export and check the notebooks")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = [] if args.skip_reports else write_reports(out)
    notebooks = export_notebooks(out)
    failed = False
    for page in reports + notebooks:
        found = problems(page)
        failed |= bool(found)
        print(f"{page.name}: {'; '.join(found) if found else 'stands alone'}")
    browser = chromium()
    if browser is None:
        print("no Chromium found (apt-get install chromium): pages checked, no screenshots taken")
        return 1 if failed else 0
    for page in reports:
        screenshot(browser, page, out / f"{page.stem}.png", height=3200)
    for page in notebooks:
        for anchor, word in anchors(page, NOTEBOOKS[page.stem]):
            screenshot(browser, page, out / f"{page.stem}-{word.replace(' ', '_')}.png", anchor)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
