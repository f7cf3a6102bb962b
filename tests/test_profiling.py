import pytest
import torch

from latentmoe_lab import LatentMoEForCausalLM
from latentmoe_lab.profiling import component_timer, prefill_decode_profile, top_ops
from latentmoe_lab.viz import profiling as viz


@pytest.fixture
def tiny_model(tiny_config):
    return LatentMoEForCausalLM(tiny_config).eval()


def test_prefill_decode_profile_covers_every_component(tiny_model):
    profile = prefill_decode_profile(tiny_model, prompt_len=12, decode_steps=3)
    for phase in ("prefill", "decode"):
        times = profile[phase]
        assert {"embeddings", "kda", "dsa", "moe", "dense_ffn", "head"} <= set(times)
        components = sum(v for k, v in times.items() if k != "wall")
        assert 0 < components <= times["wall"]
    assert len(viz.phase_breakdown_figure(profile).data) == 6


def test_timer_hooks_are_removed_and_outputs_unchanged(tiny_model):
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 9))
    with torch.no_grad():
        expected = tiny_model(ids).logits
        with component_timer(tiny_model) as seconds:
            timed = tiny_model(ids).logits
    torch.testing.assert_close(timed, expected, rtol=0, atol=0)
    assert seconds["kda"] > 0 and seconds["moe"] > 0
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in tiny_model.modules())


def test_top_ops_are_sorted_shares(tiny_model):
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 9))
    with torch.no_grad():
        rows = top_ops(lambda: tiny_model(ids), row_limit=5)
    assert len(rows) == 5 and all(r["name"].startswith("aten::") or r["name"] for r in rows)
    assert [r["self_cpu_ms"] for r in rows] == sorted((r["self_cpu_ms"] for r in rows), reverse=True)
    assert 0 < sum(r["share"] for r in rows) <= 1.0 + 1e-9


def test_bad_profile_arguments_are_refused(tiny_model):
    with pytest.raises(ValueError, match="prompt_len"):
        prefill_decode_profile(tiny_model, prompt_len=0, decode_steps=1)
