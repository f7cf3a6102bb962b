"""A transformers checkpoint with its routed experts left on disk behind a bounded expert cache gives the fully
loaded model's logits and greedy tokens (docs/design.md §17)."""
from __future__ import annotations

import pytest
import torch

from interop_cases import ragged_batch, save_kimi
from latentmoe_lab.interop.offload import CheckpointExperts, load_with_experts_on_disk
from latentmoe_lab.model import LatentMoEForCausalLM

pytest.importorskip("transformers")


def test_experts_on_disk_match_the_loaded_model(tmp_path):
    save_kimi("kda-mla-kda", tmp_path)
    full = LatentMoEForCausalLM.from_pretrained(tmp_path)
    expert_bytes = (32 * 2 * 16 + 16 * 32) * 4  # w13 [hidden, 2*inter] + w2 [inter, hidden], fp32
    lazy, cache = load_with_experts_on_disk(LatentMoEForCausalLM, tmp_path, cache_bytes=3 * expert_bytes)
    assert cache.capacity == 3
    offloaded = [block.ffn.experts for block in lazy.layers if block.is_moe]
    assert len(offloaded) == 2 and all(isinstance(m, CheckpointExperts) for m in offloaded)
    assert not any(name.startswith("layers.1.ffn.experts") for name in lazy.state_dict())
    ids, mask = ragged_batch([23, 8], seed=7)
    with torch.no_grad():
        torch.testing.assert_close(lazy(ids, attention_mask=mask).logits, full(ids, attention_mask=mask).logits,
                                   rtol=1e-6, atol=1e-6)
    assert cache.misses >= 6 and len(cache.entries) == 3  # 2 layers x 6 experts go through 3 slots
    prompt = ids[:1, :10]
    assert torch.equal(lazy.generate(prompt, max_new_tokens=8), full.generate(prompt, max_new_tokens=8))
    assert cache.hits > 0 and sum(m.bytes_read for m in offloaded) == cache.misses * expert_bytes


def test_cache_bytes_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="^cache_bytes: must be a positive number of bytes, got 0$"):
        load_with_experts_on_disk(LatentMoEForCausalLM, tmp_path, cache_bytes=0)
