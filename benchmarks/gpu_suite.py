"""The GPU suite: everything worth measuring on one lent GPU, in one run of under 8 minutes, as one table.

    bash benchmarks/gpu_suite.sh              # on the GPU machine (H200: about 5-7 minutes)
    bash benchmarks/gpu_suite.sh --dry-run    # any CPU: every stage at tiny sizes (kernels in triton's
                                              # interpreter), to check the suite itself; also GPU_SUITE_DRY_RUN=1

Stages, each in a process of its own with its own time limit (a hang or a crash ends that stage only):

    smoke     (30 s)  torch + triton import, CUDA present, one tiny routing kernel against its torch twin;
                      if it fails, the suite stops at once: nothing after it can be trusted
    kernels           every Triton kernel of latentmoe_kernels against its torch twin at realistic sizes
                      (the cases of bench_kernels.py, plus the dequantizing grouped GEMM): parity (relative
                      max diff, or share of differing picks, against a tolerance) and median time of each,
                      TFLOP/s or GB/s and share of peak
    profile           the "small" preset in bf16: prefill of 4 x 2048 tokens and 32 decode steps, seconds
                      per record_function label (profiling/labels.py) from a chrome trace of each
    engine            the serving Engine at batch 64: prefill of 64 prompts, then decode steps, ms per step

The table is printed at the end and written as JSON and markdown (gpu_suite.json, gpu_suite.md, plus the
chrome traces) to $OUT when it is set, else to benchmarks/gpu_suite/. Exit status: 0 when every stage ran
and every compared pair agreed, 1 otherwise, 2 when the smoke failed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOTAL_BUDGET_S = 470.0  # the whole suite, under 8 minutes
STAGE_LIMITS_S = {"smoke": 30.0, "kernels": 290.0, "profile": 75.0, "engine": 75.0}
KERNEL_BUDGET_S = 240.0  # the kernels stage starts no new case past this
# Parity tolerances: relative max diff for float outputs (bf16 storage, fp32 accumulation), share of
# differing picks for top-k selections (bf16 near-ties), rows placed differently for routing (exact).
TOLERANCE = {"routing": 0.0, "index top-k": 1e-2}
RELATIVE_TOLERANCE = 3e-2
# Seconds per call in triton's interpreter even at the smoke sizes; the dry run skips them, the tests
# under tests/kernels check both kernels in the interpreter.
INTERPRETER_TOO_SLOW = ("index top-k", "KDA chunked")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_SUITE_DRY_RUN") == "1",
                        help="tiny sizes on the CPU (kernels in triton's interpreter)")
    parser.add_argument("--stage", choices=list(STAGE_LIMITS_S), help=argparse.SUPPRESS)  # one stage, in-process
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)  # where --stage writes its rows
    args = parser.parse_args()
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else HERE / "gpu_suite"
    out.mkdir(parents=True, exist_ok=True)
    if args.stage:
        rows = STAGES[args.stage](args.dry_run, out)
        args.rows.write_text(json.dumps(rows))
        return 0
    return run_suite(args.dry_run, out)


# ---------------------------------------------------------------------------------------- driver
def run_suite(dry_run: bool, out: Path) -> int:
    started = time.perf_counter()
    rows: list[dict] = []
    # One CPU thread in the dry run: its ops are tiny, and on a busy machine a second OpenMP thread only waits.
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1") if dry_run else dict(os.environ)
    for stage, limit in STAGE_LIMITS_S.items():
        left = TOTAL_BUDGET_S - (time.perf_counter() - started)
        if left < 10:
            rows.append(_row(stage, "(stage)", status="skipped", note="suite time budget spent"))
            continue
        print(f"== {stage} (limit {min(limit, left):.0f} s)", flush=True)
        stage_rows = _run_stage(stage, min(limit, left), dry_run, out, env)
        rows.extend(stage_rows)
        if stage == "smoke" and any(r["status"] != "ok" for r in stage_rows):
            _report(rows, out, dry_run, time.perf_counter() - started)
            print("smoke failed: the install is broken; the suite stops here")
            return 2
    _report(rows, out, dry_run, time.perf_counter() - started)
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows) else 1


def _run_stage(stage: str, limit: float, dry_run: bool, out: Path, env: dict) -> list[dict]:
    rows_file = out / f".{stage}.rows.json"
    rows_file.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--stage", stage, "--rows", str(rows_file)]
    command += ["--dry-run"] if dry_run else []
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, timeout=limit, capture_output=True, text=True)
    except subprocess.TimeoutExpired as error:
        tail = (error.stdout or b"")[-400:] if isinstance(error.stdout, bytes) else (error.stdout or "")[-400:]
        print(tail)
        return [_row(stage, "(stage)", status="timeout", note=f"killed after {limit:.0f} s")]
    print(done.stdout, end="")
    if done.returncode != 0 or not rows_file.exists():
        print(done.stderr[-3000:])
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return [_row(stage, "(stage)", status="error", note=last[:200])]
    rows = json.loads(rows_file.read_text())
    rows_file.unlink()
    print(f"   {stage}: {time.perf_counter() - start:.1f} s", flush=True)
    return rows


def _row(stage: str, item: str, size: str = "", ms: float | None = None, twin_ms: float | None = None,
         parity: str = "", status: str = "ok", note: str = "") -> dict:
    return {"stage": stage, "item": item, "size": size, "ms": ms, "twin_ms": twin_ms,
            "speedup": None if not (ms and twin_ms) else twin_ms / ms, "parity": parity, "status": status,
            "note": note}


def _report(rows: list[dict], out: Path, dry_run: bool, seconds: float) -> None:
    header = ["stage", "item", "size", "ms", "twin ms", "twin/ms", "parity", "status", "note"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r["stage"], r["item"], r["size"], _fmt(r["ms"]), _fmt(r["twin_ms"]),
                 "" if r["speedup"] is None else f"{r['speedup']:.2f}x", r["parity"], r["status"], r["note"]]
        lines.append("| " + " | ".join(cells) + " |")
    title = f"GPU suite ({'dry run on CPU' if dry_run else 'GPU'}), {seconds:.0f} s"
    table = "\n".join([title, "", *lines])
    print("\n" + table)
    (out / "gpu_suite.md").write_text(table + "\n")
    (out / "gpu_suite.json").write_text(json.dumps({"dry_run": dry_run, "seconds": seconds, "rows": rows}, indent=2))
    print(f"\nwrote {out / 'gpu_suite.json'} and {out / 'gpu_suite.md'}")


def _fmt(ms: float | None) -> str:
    return "" if ms is None else f"{ms:.3f}"


# ---------------------------------------------------------------------------------------- stages
def stage_smoke(dry_run: bool, out: Path) -> list[dict]:
    import torch
    import triton

    if not dry_run and not torch.cuda.is_available():
        raise RuntimeError("smoke: no CUDA device visible to torch (torch.cuda.is_available() is False)")
    from latentmoe_kernels.routing import fused_route
    from latentmoe_lab.ops.routing import route_and_plan

    device = "cpu" if dry_run else "cuda"
    logits = torch.randn(64, 32, device=device)
    kernel = fused_route(logits, 4).order
    twin = route_and_plan(logits, 4, backend="torch")[2].order
    mismatched = int((kernel != twin).sum())
    name = "CPU, triton interpreter" if dry_run else torch.cuda.get_device_name()
    return [_row("smoke", "fused_route vs twin", "N=64 E=32 top-4", parity=f"{mismatched} rows differ",
                 status="ok" if mismatched == 0 else "mismatch",
                 note=f"torch {torch.__version__}, triton {triton.__version__}, {name}")]


def stage_kernels(dry_run: bool, out: Path) -> list[dict]:
    sys.path.insert(0, str(HERE))
    import bench_kernels as bench
    import torch

    device = "cpu" if dry_run else "cuda"
    name = "cpu" if dry_run else torch.cuda.get_device_name()
    spec = next((p for fragment, p in bench.SPEC_PEAKS.items() if fragment in name), (None, None, None))
    peaks = {"bf16": spec[0], "fp32": spec[1], "hbm": spec[2]}
    torch.manual_seed(0)
    rows, started = [], time.perf_counter()
    makers = (bench._routing_cases, bench._grouped_gemm_cases, bench._dsa_cases,
              lambda torch, device, smoke: _dequant_cases(bench, torch, device, smoke), bench._kda_cases)
    for make in makers:  # the slowest (KDA 64k) last, as in bench_kernels.py
        for case in make(torch, device, dry_run):
            if dry_run and case.family in INTERPRETER_TOO_SLOW:
                rows.append(_row("kernels", case.family, case.size, status="skipped",
                                 note="dry run: seconds per call in the interpreter (tests/kernels check it)"))
                continue
            if time.perf_counter() - started > KERNEL_BUDGET_S:
                rows.append(_row("kernels", case.family, case.size, status="skipped", note="stage budget spent"))
                continue
            rows.append(_kernel_row(bench, torch, case, peaks, dry_run))
            print(f"   {rows[-1]['item']:<18} {rows[-1]['size']:<40} {_fmt(rows[-1]['ms'])} ms  "
                  f"{rows[-1]['parity']}", flush=True)
            bench._free(torch, device)
    return rows


def _dequant_cases(bench, torch, device, smoke):
    """latentmoe_kernels.dequant_gemm (not in bench_kernels.py) against dequantize-then-grouped-matmul."""
    from latentmoe_kernels.dequant_gemm import dequant_grouped_gemm
    from latentmoe_lab.ops.routing import grouped_matmul
    from latentmoe_lab.quant.linear import WEIGHT_FORMATS

    # The expert down projection of one EP rank (128 of 896 experts, 3072 -> 3584) at a decode batch of 64.
    experts, d_in, d_out, tokens = (4, 64, 48, 8) if smoke else (128, 3072, 3584, 64)
    rows = tokens * 2 if smoke else tokens * 16 * experts // 896
    dtype = torch.float32 if smoke else torch.bfloat16  # the interpreter's tl.dot rejects bf16
    offsets = torch.bincount(torch.randint(0, experts, (rows,), device=device), minlength=experts).cumsum(0)
    x = torch.randn(rows, d_in, device=device, dtype=dtype)
    for fmt in ("fp8", "mxfp4"):
        packed = WEIGHT_FORMATS[fmt].pack(torch.randn(experts, d_out, d_in, device=device) * d_in ** -0.5)
        moved = sum(t.numel() * t.element_size() for t in packed.values()) + x.numel() * x.element_size() * 2

        def twin(packed=packed, fmt=fmt):
            dense = WEIGHT_FORMATS[fmt].unpack(packed)[..., :d_in].to(dtype)
            return grouped_matmul(x, dense.transpose(1, 2), offsets, backend="torch")

        yield bench.Case(f"dequant GEMM {fmt}", f"M={rows} E={experts} {d_in}->{d_out} (twin dequantizes)", moved,
                         "GB/s", "hbm", lambda packed=packed, fmt=fmt: dequant_grouped_gemm(
                             x, packed["data"], packed["scale"], offsets, fmt, d_in), twin, bench._max_abs)


def _kernel_row(bench, torch, case, peaks: dict, dry_run: bool) -> dict:
    kernel_ms, kernel_out = _time(bench, torch, case.kernel, dry_run)
    twin_ms, parity, status = None, "not compared (twin does not fit)", "ok"
    if case.reference is not None:
        twin_ms, twin_out = _time(bench, torch, case.reference, dry_run)
        parity, status = _parity(case, kernel_out, twin_out)
    achieved = case.work / (kernel_ms * 1e-3) / (1e12 if case.unit == "TFLOP/s" else 1e9)
    share = "" if not peaks[case.peak] else f", {100 * achieved / peaks[case.peak]:.1f}% of {case.peak} peak"
    return _row("kernels", case.family, case.size, kernel_ms, twin_ms, parity, status,
                f"{achieved:.1f} {case.unit}{share}")


def _time(bench, torch, fn, dry_run: bool):
    if dry_run:  # one call: the interpreter's time says nothing, the call checks the harness
        start = time.perf_counter()
        out = fn()
        return (time.perf_counter() - start) * 1e3, out
    return bench._time_ms(torch, fn, False)


def _parity(case, kernel_out, twin_out) -> tuple[str, str]:
    """(text, status) comparing a kernel's output with its twin's under the family's tolerance."""
    if case.diff is None:  # the KDA decode step updates its state in place: both calls see different states
        return "not compared (state updated in place)", "ok"
    value = case.diff(kernel_out, twin_out)
    if case.family in TOLERANCE:
        tolerance, text = TOLERANCE[case.family], f"{value:.3g} differ"
    else:
        scale = float(twin_out.float().abs().max()) if twin_out.numel() else 1.0
        value, tolerance = value / max(scale, 1e-12), RELATIVE_TOLERANCE
        text = f"rel max diff {value:.1e}"
    return f"{text} (tol {tolerance:g})", "ok" if value <= tolerance else "mismatch"


def stage_profile(dry_run: bool, out: Path) -> list[dict]:
    import torch

    from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
    from latentmoe_lab.profiling import label_seconds, load_chrome_trace, prefill_decode_profile, trace
    from latentmoe_lab.profiling.steps import decode_step, prefill_step

    preset, batch, prompt_len, steps = ("tiny", 1, 16, 2) if dry_run else ("small", 4, 2048, 32)
    device, dtype = ("cpu", torch.float32) if dry_run else ("cuda", torch.bfloat16)
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(ModelConfig.from_preset(preset)).to(device=device, dtype=dtype).eval()
    if not dry_run:
        prefill_decode_profile(model, prompt_len, 2, batch)  # warm-up: kernel compilation, allocator growth
    phases = prefill_decode_profile(model, prompt_len, steps, batch)
    size = f"{preset} {str(dtype)[6:]} B={batch} T={prompt_len}"
    rows = [_row("profile", "prefill wall", size, phases["prefill"]["wall"] * 1e3,
                 note=f"{batch * prompt_len / phases['prefill']['wall']:.0f} tokens/s"),
            _row("profile", "decode step wall", f"{size}, {steps} steps", phases["decode"]["wall"] * 1e3 / steps,
                 note=f"{batch * steps / phases['decode']['wall']:.0f} tokens/s")]
    for phase, make in (("prefill", prefill_step), ("decode", decode_step)):
        path = trace(make(model, batch, prompt_len), out / f"profile-{phase}.trace.json")
        seconds = label_seconds(load_chrome_trace(path)["traceEvents"])
        for label, s in sorted(seconds.items(), key=lambda item: item[1], reverse=True):
            rows.append(_row("profile", f"{phase} {label}", size, s * 1e3, note="exclusive, from the trace"))
    return rows


def stage_engine(dry_run: bool, out: Path) -> list[dict]:
    import torch

    try:
        from latentmoe_lab.serving import Engine  # noqa: F401
    except ImportError:
        print("   latentmoe_lab.serving.Engine does not exist yet: engine stage skipped")
        return [_row("engine", "(stage)", status="skipped", note="latentmoe_lab.serving.Engine not found")]
    from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
    from latentmoe_lab.profiling.cli import decoding_engine

    preset, batch, prompt_len, steps = ("tiny", 2, 8, 2) if dry_run else ("small", 64, 256, 16)
    device, dtype = ("cpu", torch.float32) if dry_run else ("cuda", torch.bfloat16)
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(ModelConfig.from_preset(preset)).to(device=device, dtype=dtype).eval()
    start = time.perf_counter()
    engine = decoding_engine(model, batch, prompt_len, new_tokens=steps + 2)
    prefill_s = time.perf_counter() - start
    engine.step()  # the first decode step (warm-up)
    _sync(torch)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(torch)
    step_s = (time.perf_counter() - start) / steps
    size = f"{preset} {str(dtype)[6:]} batch {batch}, prompts of {prompt_len}"
    return [_row("engine", "prefill (all requests)", size, prefill_s * 1e3,
                 note=f"{batch * prompt_len / prefill_s:.0f} tokens/s, includes first-call compilation"),
            _row("engine", "decode step", size, step_s * 1e3, note=f"{batch / step_s:.0f} tokens/s")]


def _sync(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


STAGES = {"smoke": stage_smoke, "kernels": stage_kernels, "profile": stage_profile, "engine": stage_engine}

if __name__ == "__main__":
    sys.exit(main())
