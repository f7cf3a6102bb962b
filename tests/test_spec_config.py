"""The service file's speculative: section: its checks, the drafter it names, and what the engine refuses at start."""
import pytest

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.serving import Engine, ServiceConfig
from latentmoe_lab.serving.spec import NgramDrafter
from latentmoe_lab.serving.spec.mtp_batched import BatchedMTPDrafter
from latentmoe_lab.serving.spec.setup import make_drafter


def _config(speculative) -> ServiceConfig:
    return ServiceConfig.from_dict({"model": {"max_model_len": 256}, "memory": {"max_num_seqs": 2, "block_size": 16,
                                    "cache_bytes": 1 << 22}, "speculative": speculative})


@pytest.mark.parametrize("section, key", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "speculative.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 9}, "speculative.num_speculative_tokens"),
    ({"method": "mtp"}, "speculative.num_speculative_tokens"),
    ({"num_speculative_tokens": 2}, "speculative.method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "speculative.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "speculative.prompt_lookup_max"),
    ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "speculative.prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "speculative.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_model": "x"}, "speculative.draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_cost": 0.5}, "speculative.draft_cost"),
    ({"method": "ngram", "num_speculative_tokens": 3, "adaptive": False, "probe_interval": 4},
     "speculative.probe_interval"),
    ({"method": "mtp", "num_speculative_tokens": 3, "adaptive": True, "draft_cost": 0}, "speculative.draft_cost"),
    ({"method": "mtp", "num_speculative_tokens": 3, "adaptive": True, "draft_cost": "cheap"},
     "speculative.draft_cost"),
    ({"method": "mtp", "num_speculative_tokens": 3, "adaptive": True, "probe_interval": 0},
     "speculative.probe_interval"),
    ({"method": "ngram", "num_speculative_tokens": 3, "adaptive": "yes"}, "speculative.adaptive"),
    ({"method": "ngram", "num_speculative_tokens": 3, "max_context": 0}, "speculative.max_context"),
    ({"max_context": 4096}, "speculative.method"),
])
def test_bad_speculative_sections_name_the_key(section, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        _config(section)


def test_sections_read_from_yaml_and_name_their_drafter(tmp_path):
    path = tmp_path / "service.yaml"
    path.write_text("model: {preset: tiny, max_model_len: 256}\nmemory: {cache_bytes: 4194304}\n"
                    "speculative:\n  method: ngram\n  num_speculative_tokens: 5\n  prompt_lookup_max: 6\n")
    spec = ServiceConfig.from_yaml(path).speculative
    assert (spec.method, spec.num_speculative_tokens, spec.lookup_range) == ("ngram", 5, (1, 6))
    drafter = make_drafter(spec, model=None)
    assert isinstance(drafter, NgramDrafter) and drafter.prompt_lookup_max == 6
    assert not _config(None).speculative.enabled and make_drafter(_config(None).speculative, None) is None
    head = LatentMoEForCausalLM(ModelConfig.from_preset("tiny").replace(mtp_depth=1, vision=None))
    assert isinstance(make_drafter(_config({"method": "mtp", "num_speculative_tokens": 2}).speculative, head),
                      BatchedMTPDrafter)  # the serial MTPDrafter is its reference twin (tests/test_spec_mtp_batched.py)


def test_the_engine_refuses_mtp_without_a_head_before_allocating_anything(model, monkeypatch):
    from latentmoe_lab.serving import model_runner  # the runner allocates the pools it owns

    allocated, allocate = [], model_runner.allocate_pools
    monkeypatch.setattr(model_runner, "allocate_pools", lambda *a, **k: allocated.append(a) or allocate(*a, **k))
    with pytest.raises(ValueError, match=r"speculative\.method: 'mtp' needs a model with an MTP head"):
        Engine(model, _config({"method": "mtp", "num_speculative_tokens": 3}))
    assert allocated == []
    head = LatentMoEForCausalLM(ModelConfig.from_preset("tiny").replace(mtp_depth=1)).eval()
    for method, which in (("ngram", model), ("mtp", head)):
        engine = Engine(which, _config({"method": method, "num_speculative_tokens": 2}))
        assert engine.speculator.drafter.name == method and engine.plan.num_slots == 2 * 3  # K + 1 per sequence
    Engine(model, _config(None))  # absent: off, and the engine starts
    assert len(allocated) == 3
