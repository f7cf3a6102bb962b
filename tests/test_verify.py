"""`latentmoe-lab verify` (docs/design.md §19): every state-moving path a service file turns on, compared with the
reference path; each planted corruption caught and named, with the first divergent layer."""
import ast
import pathlib

import pytest

from verify_cases import BASE, NGRAM, model, verify  # noqa: F401
from latentmoe_lab.serving import scheduler as scheduler_module
from latentmoe_lab.verify.inject import INJECTIONS, NEEDS, check_injection
from latentmoe_lab.verify.report import PATHS
from latentmoe_lab.verify.workload import build_workload

SPILL = {"memory": BASE["memory"] | {"prefix_cache": {"host_bytes": 2_000_000}}}
EVERY_PATH = BASE | NGRAM | SPILL  # prefix hits, tiers, speculation, chunking, preemption (tight pass), batching


def test_workload_walks_split_points_and_fits():
    prompts = build_workload(5, 512, 16, 32, 200, seed=3)
    assert [p.wave for p in prompts].count("cold") == 5 and len(prompts) == 15
    assert all(1 <= len(p.token_ids) <= 200 for p in prompts)
    cold = [p.token_ids for p in prompts if p.wave == "cold"]
    assert len(cold[0]) % 16 != 0 and len(cold[1]) == 32  # a prefix ending inside a block; one on a block edge
    assert len(cold[2]) > 32  # longer than a prefill chunk
    assert build_workload(5, 512, 16, 32, 200, seed=3) == prompts  # same seed, same prompts
    with pytest.raises(ValueError, match="num_prompts"):
        build_workload(3, 512, 16, 32, 200, seed=0)


def test_a_file_turning_on_every_path_passes_with_each_path_exercised(model):
    report = verify(model, EVERY_PATH)
    assert report.passed, report.table()
    rows = {row.path: row for row in report.rows}
    assert set(rows) == {"batching", "chunked prefill", "preemption", "prefix hit", "tier restore", "spec verify"}
    for row in rows.values():  # exercised, compared, within the fp32 tolerance
        assert row.requests > 0 and row.tokens > 0 and row.max_gap <= report.tolerance, report.table()


@pytest.mark.parametrize("name", INJECTIONS)
def test_every_planted_corruption_is_caught_and_named(model, name):
    report = verify(model, EVERY_PATH, inject=name)
    assert not report.passed, report.table()
    divergence = report.divergence
    assert divergence.path in NEEDS[name] + ("tier restore",), report.table()  # a tier restore is a prefix hit
    assert divergence.layer and divergence.layer.startswith("layers."), report.table()
    assert scheduler_module.keep_slot_of.__name__ == "keep_slot_of"  # the swap is undone after the run


def test_pd_transfers_pass_and_a_zeroed_transferred_state_is_caught(model):
    pd = BASE | {"disaggregation": {"prefill_instances": 1, "decode_instances": 1}}
    report = verify(model, pd)
    assert report.passed and {r.path: r for r in report.rows}["p/d import"].requests > 0, report.table()
    for name in ("zero-kda-state", "drop-conv-tail"):
        bad = verify(model, pd, inject=name)
        assert not bad.passed and bad.divergence.path in ("p/d import", "prefix hit"), bad.table()


def test_batch_invariant_fp32_is_compared_bit_for_bit(model):
    invariant = {"model": {"preset": "tiny", "max_model_len": 512},
                 "memory": BASE["memory"] | {"block_size": 64, "cache_bytes": 8_000_000},
                 "scheduler": {"max_batch_size": 16, "prefill_chunk_size": 128, "batch_invariant": True}}
    report = verify(model, invariant)
    assert report.tolerance == 0.0 and "bit-exact" in report.mode
    assert report.passed, report.table()


def test_injections_are_refused_when_unknown_or_when_the_file_lacks_their_path():
    with pytest.raises(ValueError, match="choose one of zero-kda-state"):
        check_injection("zero-state", PATHS)
    with pytest.raises(ValueError, match="stale-spec-slot corrupts the spec verify path"):
        check_injection("stale-spec-slot", ["batching", "prefix hit"])


def test_no_serving_module_knows_about_verify():
    """The injections cost nothing when off because serving holds no hook for them: nothing in serving/ or
    server/ imports latentmoe_lab.verify."""
    root = pathlib.Path(__file__).parent.parent / "latentmoe_lab"
    for package in ("serving", "server"):
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                    assert not any(n.startswith("latentmoe_lab.verify") for n in names), path
