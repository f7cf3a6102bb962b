"""`latentmoe-lab verify` on one service that turns on every path it can in one process, clean and with each
planted corruption: the tables README and docs/design.md §19 show (written to verify_all_paths.txt).

    python benchmarks/verify_all_paths.py

The service: prefix caching with a host spill tier, memory.offload, n-gram speculation (K=2) and a prefill/
decode split (two in-process engines on the role configs, every request through the wire format). The model is
tests/verify_cases.py's repeating tiny model, whose greedy output repeats, so drafts are accepted as on a
trained model (a random model accepts almost none, and verify would report the spec path UNTESTED).
Expert migration and worker layouts need worker processes: `make verify-matrix` covers them.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # verify_cases: the shared test model

from verify_cases import BASE, NGRAM, repeating_model, verify  # noqa: E402

from latentmoe_lab.verify.inject import INJECTIONS  # noqa: E402

EVERY_PATH = BASE | NGRAM | {
    "memory": BASE["memory"] | {"prefix_cache": {"host_bytes": 2_000_000},
                                "offload": {"host_cache_bytes": 2_000_000, "hot_rows_per_layer": 40}},
    "disaggregation": {"prefill_instances": 1, "decode_instances": 1}}


def main() -> int:
    model = repeating_model()
    lines, caught = [], []
    for injection in (None, *INJECTIONS):
        start = time.perf_counter()
        report = verify(model, EVERY_PATH, inject=injection)
        lines += [report.table(), f"({time.perf_counter() - start:.1f} s)", ""]
        caught.append(report.passed == (injection is None))
        print(lines[-3], flush=True)
    out = Path(__file__).with_name("verify_all_paths.txt")
    out.write_text("\n".join(lines))
    print(f"written {out}; clean run passes and every injection caught: {all(caught)}")
    return 0 if all(caught) else 1


if __name__ == "__main__":
    raise SystemExit(main())
