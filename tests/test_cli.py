import re
import subprocess
import sys

from latentmoe_lab.cli import main


def test_smoke_run_exits_zero_and_writes_report(tmp_path, capsys):
    report = tmp_path / "smoke.html"
    assert main(["smoke", "--new-tokens", "4", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "max/mean" in out and "kda_state" in out
    page = report.read_text()
    assert "Plotly.newPlot" in page and page.count("Plotly.newPlot") >= 4
    assert not re.search(r"<script[^>]*\bsrc=", page)  # self-contained: plotly.js is inlined, nothing fetched


def test_info_prints_the_table(capsys):
    assert main(["info", "--preset", "tiny"]) == 0
    assert "routed_experts" in capsys.readouterr().out


def test_help_and_module_entry_point():
    done = subprocess.run([sys.executable, "-m", "latentmoe_lab", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "smoke" in done.stdout and "info" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "latentmoe_lab", "info", "--preset", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
