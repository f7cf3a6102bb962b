"""DeepSeek-V3.2 checkpoints in and out (interop/deepseek_v32.py, docs/design.md §17).

Tiny random DeepseekV32ForCausalLM models that transformers itself builds and saves (fp32, every weight and
the correction bias randomised away from their init so a layout slip shows) are loaded into our one model class:
logits equal transformers' on ragged batches, greedy tokens equal, the engine's too, and ours -> hf -> ours is
bit-exact. The configs cover plain RoPE and YaRN, dense-first and all-MoE layer patterns, group-limited and
plain routing, norm_topk_prob off, tied embeddings, and index top-k both below and above the contexts.
"""
import json

import pytest
import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.interop import deepseek_v32
from latentmoe_lab.interop.export import export_transformers
from latentmoe_lab.interop.load import load_transformers
from latentmoe_lab.interop.names import Unexpressible
from latentmoe_lab.model import LatentMoEForCausalLM

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=8,
            routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
            index_topk=5, index_head_dim=16, index_n_heads=8, max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0})
CASES = {
    # index top-k 5 < every context past 5 tokens: the indexer's selection decides
    "rope_dense_first": {},
    # YaRN with both mscales (attention factor and softmax correction), no dense layer, plain routing, tied
    "yarn_all_moe": dict(first_k_dense_replace=0, n_group=1, topk_group=1, norm_topk_prob=False,
                         tie_word_embeddings=True, n_shared_experts=2, index_topk=7,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 64, "mscale": 0.8,
                                          "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2}),
    # index top-k above every context: dense causal MLA in effect; two dense layers first
    "topk_above_context": dict(num_hidden_layers=4, first_k_dense_replace=2, index_topk=128),
}
LENGTHS = (21, 13, 6)  # ragged rows, right-padded for the forward, left-padded for generate


def _saved_hf(tmp_path, case: str):
    """A transformers DeepseekV32ForCausalLM with random weights, saved to tmp_path/hf; (model, directory)."""
    torch.manual_seed(0)
    config = transformers.DeepseekV32Config(**(BASE | CASES[case]))
    config._attn_implementation = "eager"
    model = transformers.DeepseekV32ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.2 * torch.randn_like(tensor))
            elif tensor.is_floating_point() and "inv_freq" not in name:
                tensor.copy_(0.15 * torch.randn_like(tensor))
    directory = tmp_path / "hf"
    model.save_pretrained(directory)
    return model, directory


def _ragged_ids(vocab: int, left: bool):
    ids = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        span = slice(max(LENGTHS) - n, None) if left else slice(0, n)
        ids[row, span] = torch.randint(2, vocab, (n,))
        mask[row, span] = 1
    return ids, mask


def _assert_logits_close(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor) -> None:
    """Relative error over the real tokens, against the largest logit, within 1e-5."""
    real = mask.bool()
    error = (ours[real] - theirs[real]).abs().max() / theirs[real].abs().max()
    assert error <= 1e-5, f"logits differ by {error:.2e} relative"


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_tokens_equal_transformers(tmp_path, case):
    theirs, directory = _saved_hf(tmp_path, case)
    ours = load_transformers(LatentMoEForCausalLM, directory)
    assert ours.config.mla.rope == ("yarn" if case == "yarn_all_moe" else "rope")
    ids, mask = _ragged_ids(BASE["vocab_size"], left=False)
    with torch.no_grad():
        _assert_logits_close(ours(ids, attention_mask=mask).logits, theirs(ids, attention_mask=mask).logits, mask)
        ids, mask = _ragged_ids(BASE["vocab_size"], left=True)
        theirs.generation_config.eos_token_id = None
        expected = theirs.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        got = ours.generate(ids, attention_mask=mask, max_new_tokens=8)
    assert got[:, ids.shape[1]:].tolist() == expected[:, ids.shape[1]:].tolist()


def test_round_trip_is_bit_exact_and_transformers_reads_the_export(tmp_path):
    theirs, directory = _saved_hf(tmp_path, "yarn_all_moe")
    ours = load_transformers(LatentMoEForCausalLM, directory)
    exported = export_transformers(ours, tmp_path / "out", "deepseek_v32")
    again = load_transformers(LatentMoEForCausalLM, exported)
    assert again.config == ours.config
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    reread = transformers.AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager").float().eval()
    ids, mask = _ragged_ids(BASE["vocab_size"], left=False)
    with torch.no_grad():
        _assert_logits_close(ours(ids, attention_mask=mask).logits, reread(ids, attention_mask=mask).logits, mask)
    assert json.loads((exported / "config.json").read_text())["rope_parameters"]["mscale"] == 0.8


@pytest.mark.parametrize("paged_reads", ["blocks", "gather"])
def test_engine_greedy_tokens_equal_generate_with_rope(tmp_path, paged_reads):
    """The paged engine (prefix caching on, chunked prefill, both ways of reading the pool) stores keys rotated
    at their positions, as the contiguous cache does, and rotates each query at its own."""
    from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig

    _, directory = _saved_hf(tmp_path, "rope_dense_first")
    ours = load_transformers(LatentMoEForCausalLM, directory)
    for layer in ours.layers:
        layer.attn.paged_reads = paged_reads
    prompts = [[5, 9, 11], [5, 9, 11, 40, 41, 7, 3, 60, 2, 18, 33, 70, 12, 4, 8, 90, 17, 25], list(range(2, 40))]
    service = {"model": {"max_model_len": 128},
               "memory": {"max_num_seqs": 3, "block_size": 16, "cache_bytes": 2_000_000, "prefix_cache": {}},
               "scheduler": {"max_batch_size": 8, "prefill_chunk_size": 16}}
    outputs = Engine(ours, ServiceConfig.from_dict(service)).generate(prompts, SamplingParams(max_tokens=6),
                                                                       use_tqdm=False)
    with torch.no_grad():
        expected = [ours.generate(torch.tensor([p]), max_new_tokens=6)[0, len(p):].tolist() for p in prompts]
    assert [o.token_ids for o in outputs] == expected


def test_config_round_trip_and_checkpoint_features():
    hf = transformers.DeepseekV32Config(**(BASE | CASES["yarn_all_moe"])).to_dict()
    config = deepseek_v32.config_from_hf(hf)
    assert (config.mla.yarn_factor, config.mla.yarn_original_max_position, config.mla.yarn_mscale) == (4.0, 64, 0.8)
    assert config.first_dense_layers == 0 and not config.moe.norm_topk_prob and config.tie_word_embeddings
    assert not config.moe.latent_projection and not config.mla.output_gate and config.layer_types == ["dsa"] * 3
    assert deepseek_v32.config_from_hf(deepseek_v32.config_to_hf(config)) == config
    tied = LatentMoEForCausalLM(config).state_dict()
    assert [entry.ours for entry in deepseek_v32.name_table(config)] == [n for n in tied if n != "lm_head.weight"]
    legacy = dict(hf, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                    "mscale": 0.8, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
                  rope_theta=1000.0)
    del legacy["rope_parameters"]
    assert deepseek_v32.config_from_hf(legacy) == config  # the older config.json spelling reads the same


@pytest.mark.parametrize("change, key", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(mlp_layer_types=["sparse", "dense", "sparse"]), "mlp_layer_types"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}), "rope_parameters"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps"),
    (dict(num_key_value_heads=1), "num_key_value_heads"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(q_lora_rank=None), "q_lora_rank"),  # transformers' deepseek_v32 cannot build one either
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}), "quantization_config"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0, "factor": 2.0}), "rope_parameters"),
])
def test_unsupported_checkpoint_features_are_named(change, key):
    hf = transformers.DeepseekV32Config(**BASE).to_dict() | change
    with pytest.raises(ValueError) as error:
        deepseek_v32.config_from_hf(hf)
    assert str(error.value).startswith(f"{key}:") and "\n" not in str(error.value)


@pytest.mark.parametrize("change, feature", [
    ({}, "KDA layers"),  # the tiny preset is hybrid
    (dict(layer_types=["dsa"] * 4), "latent experts"),
])
def test_export_refuses_what_deepseek_v32_cannot_hold(tmp_path, change, feature):
    config = ModelConfig.from_preset("tiny").replace(vision=None, **change)
    with pytest.raises(Unexpressible, match=feature):
        export_transformers(LatentMoEForCausalLM(config), tmp_path / "out", "deepseek_v32")
    assert not (tmp_path / "out").exists()


def test_rope_config_rules():
    mla = ModelConfig.from_preset("tiny").mla.__dict__
    tiny = ModelConfig.from_preset("tiny")
    assert tiny.mla.rope == "none"  # presets and existing checkpoints stay NoPE
    for change, key in [(dict(yarn_factor=2.0), "mla.yarn_factor"), (dict(rope_theta=500.0), "mla.rope_theta"),
                        (dict(rope="yarn"), "mla.yarn_original_max_position"), (dict(rope="alibi"), "mla.rope"),
                        (dict(rope="rope", qk_rope_head_dim=7), "mla.qk_rope_head_dim")]:
        with pytest.raises(ValueError, match=f"^{key}:"):
            tiny.replace(mla=mla | change)
    with pytest.raises(ValueError, match="^indexer.head_dim:"):
        tiny.replace(mla=mla | dict(rope="rope", qk_rope_head_dim=32, qk_nope_head_dim=8),
                     indexer=dict(tiny.indexer.__dict__, head_dim=16))
