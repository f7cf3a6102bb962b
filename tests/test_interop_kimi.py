"""kimi_linear checkpoints that transformers itself saved: our logits, greedy tokens (generate and the serving
engine) equal transformers'; ours -> transformers -> ours is bit-exact and transformers reads the export with
equal logits (docs/design.md §17). fp32, tiny dims, several layer patterns, ragged batches."""
from __future__ import annotations

import pytest
import torch

from interop_cases import KIMI_CASES, assert_relative_close, ragged_batch, save_kimi
from latentmoe_lab.config import DSA, KDA
from latentmoe_lab.interop.export import export_transformers
from latentmoe_lab.model import LatentMoEForCausalLM

pytest.importorskip("transformers")

LENGTHS = [29, 11, 40]  # ragged: right-padded to 40, past one KDA chunk of the kimi config (64 is ours; 16 below)


@pytest.fixture(scope="module", params=sorted(KIMI_CASES))
def pair(request, tmp_path_factory):
    """(transformers model, our model loaded from the directory transformers wrote, that directory)."""
    directory = tmp_path_factory.mktemp(request.param)
    theirs = save_kimi(request.param, directory)
    ours = LatentMoEForCausalLM.from_pretrained(directory)
    for block in ours.layers:  # a small KDA chunk so the 40-token rows cross chunk boundaries
        if block.attention_type == KDA:
            block.attn.chunk_size = 16
    return theirs, ours, directory


def test_config_follows_the_checkpoint(pair):
    theirs, ours, _ = pair
    kinds = theirs.config.layer_types
    assert ours.config.layer_types == [KDA if k == "linear_attention" else DSA for k in kinds]
    assert ours.config.first_dense_layers == theirs.config.mlp_layer_types.count("dense")
    assert not ours.config.tie_word_embeddings  # transformers ties nothing in kimi_linear, whatever the flag says
    assert not ours.config.moe.latent_projection and not ours.config.mla.output_gate
    assert not ours.config.dsa.use_indexer and ours.config.kda.gate_form == "softplus"


def test_logits_equal_transformers_on_a_ragged_batch(pair):
    theirs, ours, _ = pair
    ids, mask = ragged_batch(LENGTHS)
    with torch.no_grad():
        expected = theirs(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    for row, length in enumerate(LENGTHS):
        assert_relative_close(got[row, :length], expected[row, :length])


def test_greedy_generate_equals_transformers(pair):
    theirs, ours, _ = pair
    ids, _ = ragged_batch([9], seed=1)
    expected = theirs.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, max_new_tokens=12), expected)


def test_engine_greedy_tokens_equal_transformers_with_prefix_caching(pair):
    from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig

    theirs, ours, _ = pair
    shared = ragged_batch([20], seed=2)[0][0].tolist()
    prompts = [shared + [5, 6], shared + [7], ragged_batch([6], seed=3)[0][0].tolist()]
    service = ServiceConfig.from_dict({"model": {"max_model_len": 256},
                                       "memory": {"cache_bytes": 8 << 20, "block_size": 16,
                                                  "prefix_cache": {}}})
    outputs = Engine(ours, service).generate(prompts, SamplingParams(max_tokens=6), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert output.token_ids == expected[0, len(prompt):].tolist()


def test_round_trip_is_bit_exact_and_transformers_reads_the_export(pair, tmp_path):
    from transformers import AutoModelForCausalLM

    _, ours, _ = pair
    out = export_transformers(ours, tmp_path / "hf", "kimi_linear", max_shard_size=20_000)  # several shards
    assert (out / "model.safetensors.index.json").is_file()
    back = LatentMoEForCausalLM.from_pretrained(out)
    before, after = ours.state_dict(), back.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    reread, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids, mask = ragged_batch(LENGTHS, seed=4)
    with torch.no_grad():
        expected, got = reread.eval()(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    for row, length in enumerate(LENGTHS):
        assert_relative_close(got[row, :length], expected[row, :length])


def test_alignment_taps_against_transformers_find_no_divergence(pair):
    from latentmoe_lab.alignment.compare import compare
    from latentmoe_lab.interop.transformers_taps import TransformersCandidate

    theirs, ours, _ = pair
    ids, _ = ragged_batch([33, 33], seed=8)
    report = compare(ours, TransformersCandidate(theirs, ours.config), ids,
                     thresholds={"rel_l2": 1e-5, "routing_flips": 0.0, "weight_max_abs": 1e-5})
    assert report.first_divergence is None
    assert {row.name for row in report.rows} >= {"embed", "logits", "layers.1.attn", "layers.2.residual"}
    assert any(row.kind == "experts" for row in report.rows)
