"""The README's serving-engine snippet runs as a plain script, from a file and from stdin.

configs/service-cpu.yaml sets parallel.forward_process, so the Engine starts a worker process. A
spawn / forkserver child used to re-run the caller's main script first: without an
`if __name__ == "__main__":` guard that child built an Engine of its own while bootstrapping
(multiprocessing's RuntimeError, then BrokenPipeError), and `python - < s.py` had no file to re-run
(FileNotFoundError '<stdin>'). The snippet is taken from README.md as written, after a tiny model.
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "top level ran"

HEADER = f"""\
import torch
from latentmoe_lab import LatentMoEForCausalLM, ModelConfig

print({MARKER!r}, flush=True)
torch.manual_seed(0)
model = LatentMoEForCausalLM(ModelConfig.from_preset("tiny"))
"""
FOOTER = """
print("tokens", outs[0].token_ids, outs[1].token_ids, flush=True)
"""


def readme_engine_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    matching = [block for block in blocks if "Engine(model, ServiceConfig.from_yaml(" in block]
    assert len(matching) == 1, "README.md: expected one python block that builds the Engine"
    return matching[0]


def test_readme_engine_snippet_runs_as_a_script_and_from_stdin(tmp_path):
    snippet = readme_engine_snippet()
    assert "forward_process: true" in (ROOT / "configs" / "service-cpu.yaml").read_text()  # the case that broke
    script = tmp_path / "s.py"
    script.write_text(HEADER + snippet + FOOTER)
    runs = {"file": subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True),
            "stdin": subprocess.Popen([sys.executable, "-"], cwd=ROOT, stdin=script.open(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)}
    outputs = {}
    try:
        for name, process in runs.items():
            outputs[name] = process.communicate(timeout=240)[0]
            assert process.returncode == 0, (name, outputs[name][-3000:])
    finally:
        for process in runs.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    tokens = {}
    for name, output in outputs.items():
        assert output.count(MARKER) == 1, (name, "the caller's top level ran again", output[-3000:])
        lines = [line for line in output.splitlines() if line.startswith("tokens ")]
        assert len(lines) == 1, (name, output[-3000:])
        tokens[name] = lines[0]
    # both: 16 greedy tokens per prompt from the same seeded model
    assert tokens["file"] == tokens["stdin"]
    assert len(re.findall(r"\d+", tokens["file"])) == 32
