"""ServiceConfig validation, the shipped configs, and planner bytes == allocated bytes (docs/design.md §6.1, §6.2)."""
from pathlib import Path

import pytest
import torch
import yaml

from latentmoe_lab import ModelConfig
from latentmoe_lab.quant import kv_bytes_per_token
from latentmoe_lab.serving import ServiceConfig
from latentmoe_lab.serving.planner import allocate_pools, plan_cache
from latentmoe_lab.serving.service_plan import gqa_reference_bytes, per_sequence_bytes, plan_service

CONFIGS = Path(__file__).parents[1] / "configs"


def test_public_example_is_verbatim_and_parses():
    text = (CONFIGS / "service-example.yaml").read_text()
    assert yaml.safe_load(text) == {
        "model": {"name": "large-moe-model", "max_model_len": 1000000, "dtype": "fp8"},
        "parallel": {"tensor_parallel_size": 8, "expert_parallel_size": 8, "pipeline_parallel_size": 2},
        "memory": {"kv_cache_dtype": "fp8", "gpu_memory_utilization": 0.92, "enable_paged_attention": True,
                   "max_num_seqs": 64},
        "scheduler": {"max_batch_size": 256, "chunked_prefill": True, "prefill_chunk_size": 8192}}
    config = ServiceConfig.from_yaml(CONFIGS / "service-example.yaml")
    assert config.memory.block_size == 64 and config.memory.cache_bytes is None  # our defaults
    assert config.cache_dtype == "fp8"


def test_cpu_config_parses_and_plans():
    config = ServiceConfig.from_yaml(CONFIGS / "service-cpu.yaml")
    plan = plan_cache(ModelConfig.from_preset(config.model.preset), config)
    assert plan.total_bytes <= config.memory.cache_bytes
    assert plan.num_blocks * plan.block_size >= config.model.max_model_len


@pytest.mark.parametrize("data,message", [
    ({"scheduler": {"prefill_chunk_size": 0}}, "scheduler.prefill_chunk_size: must be a positive integer"),
    ({"scheduler": {"prefill_chunk_size": "8k"}}, "scheduler.prefill_chunk_size: expected int"),
    ({"scheduler": {"chunked_prefill": "yes"}}, "scheduler.chunked_prefill: expected bool"),
    ({"memory": {"max_num_seqs": True}}, "memory.max_num_seqs: expected int"),
    ({"memory": {"block_sise": 16}}, "memory.block_sise: unknown key"),
    ({"memory": {"gpu_memory_utilization": 1.5}}, "memory.gpu_memory_utilization: must be a number in"),
    ({"memory": {"kv_cache_dtype": "int3"}}, "memory.kv_cache_dtype: must be one of"),
    ({"memory": {"enable_paged_attention": False}}, "memory.enable_paged_attention: must be true"),
    ({"memory": {"prefix_snapshot_slots": 4}}, "memory.prefix_snapshot_slots: snapshots serve prefix caching"),
    ({"memory": {"device": "TPU"}}, "memory.device: must be one of"),
    ({"memory": {"max_num_seqs": 64}, "scheduler": {"max_batch_size": 8}}, "scheduler.max_batch_size: \\(8\\) must be >="),
    ({"model": {"preset": "huge"}}, "model.preset: must be one of"),
    ({"model": {"preset": "tiny", "checkpoint": "ckpt/"}}, "model.checkpoint: give model.preset or"),
    ({"model": {"max_model_len": -1}}, "model.max_model_len: must be a positive integer"),
    ({"parallel": {"tensor_parallel_size": 0}}, "parallel.tensor_parallel_size: must be a positive integer"),
    ({"parallel": {"group_timeout_s": 0}}, "parallel.group_timeout_s: must be a number of seconds in \\(0, 3600\\]"),
    ({"parallel": {"group_timeout_s": -1.5}}, "parallel.group_timeout_s: must be a number of seconds"),
    ({"parallel": {"group_timeout_s": float("inf")}}, "parallel.group_timeout_s: must be a number of seconds"),
    ({"parallel": {"group_timeout_s": float("nan")}}, "parallel.group_timeout_s: must be a number of seconds"),
    ({"parallel": {"group_timeout_s": "30s"}}, "parallel.group_timeout_s: expected float"),
    ({"parallel": {"group_timeout_s": True}}, "parallel.group_timeout_s: expected float"),
    ({"serving": {}}, "serving: unknown section"),
    ({"memory": [1, 2]}, "memory: expected a mapping"),
])
def test_validation_names_the_key_path(data, message):
    with pytest.raises(ValueError, match=message):
        ServiceConfig.from_dict(data)


def test_group_timeout_reaches_the_worker_layout():
    from latentmoe_lab.serving.parallel_runner import serving_layout

    assert ServiceConfig.from_dict({}).parallel.group_timeout_s == 30.0
    service = ServiceConfig.from_dict({"parallel": {"tensor_parallel_size": 2, "group_timeout_s": 7}})
    assert serving_layout(ModelConfig.from_preset("tiny"), service.parallel).timeout_s == 7.0


def test_from_yaml_refuses_a_missing_file(tmp_path):
    with pytest.raises(ValueError, match="path"):
        ServiceConfig.from_yaml(tmp_path / "nope.yaml")


def service(kv_cache_dtype="auto", prefix=True, block=16, budget=1_000_000, max_len=256):
    return ServiceConfig.from_dict({
        "model": {"max_model_len": max_len},
        "memory": {"cache_bytes": budget, "block_size": block, "max_num_seqs": 3, "enable_prefix_caching": prefix,
                   "prefix_snapshot_slots": 5 if prefix else None, "kv_cache_dtype": kv_cache_dtype}})


@pytest.mark.parametrize("kv_cache_dtype", ["fp32", "bf16", "fp8", "int8"])
@pytest.mark.parametrize("prefix", [False, True])
def test_planned_bytes_equal_allocated_bytes(kv_cache_dtype, prefix):
    config = ModelConfig.from_preset("tiny")
    plan = plan_cache(config, service(kv_cache_dtype, prefix))
    pools = allocate_pools(config, plan)
    allocated = pools.nbytes()
    assert sum(allocated.values()) == plan.total_bytes <= plan.budget
    planned = plan.bytes_by_kind()
    assert all(planned[kind] == allocated[kind] for kind in allocated)  # latent, index, state, conv: each
    assert plan.budget - plan.total_bytes < plan.block_bytes  # the leftover is less than one more block
    assert pools.num_slots == 3 + (5 if prefix else 0)
    assert planned["kda_snapshots (included above)"] == (5 if prefix else 0) * plan.slot_bytes


@pytest.mark.parametrize("cache_dtype", ["fp8", "int8"])
def test_quantized_blocks_count_the_codec_bytes_and_allocate_them(cache_dtype):
    """fp8 / int8 blocks are sized by quant's codecs (scales included) and the pools hold exactly that."""
    config = ModelConfig.from_preset("tiny")
    plan = plan_cache(config, service(cache_dtype))
    dsa = config.layer_types.count("dsa")
    per_token = kv_bytes_per_token(config, cache_dtype)
    assert plan.block_bytes == dsa * plan.block_size * (per_token["mla"] + per_token["index"])
    assert sum(allocate_pools(config, plan).nbytes().values()) == plan.total_bytes


def test_planner_refuses_budgets_that_cannot_serve_one_sequence():
    config = ModelConfig.from_preset("tiny")
    with pytest.raises(ValueError, match="memory.cache_bytes: .* KDA slots"):
        plan_cache(config, service(budget=1000))
    with pytest.raises(ValueError, match="fewer than one model.max_model_len sequence"):
        plan_cache(config, service(budget=100_000, max_len=4096))
    with pytest.raises(ValueError, match="memory.cache_bytes: required"):
        plan_cache(config, ServiceConfig.from_dict({}))


def test_service_plan_splits_the_model_over_devices():
    """A small preset on TP 2 x EP 2 x PP 2: each stage's device plans its own layers, heads / TP, seqs / EP."""
    config = ModelConfig.from_preset("small")
    svc = ServiceConfig.from_dict({"model": {"max_model_len": 65536, "dtype": "bf16"},
                                   "parallel": {"tensor_parallel_size": 2, "expert_parallel_size": 2,
                                                "pipeline_parallel_size": 2},
                                   "memory": {"max_num_seqs": 8, "device": "H100-80GB",
                                              "gpu_memory_utilization": 0.5}})
    stages = plan_service(svc, config)
    assert len(stages) == 2 and sum(len(s.layers) for s in stages) == config.num_layers
    for stage in stages:
        assert stage.cache is not None and stage.cache.num_slots == 4  # 8 sequences over 2 EP ranks
        assert stage.weights + stage.activations + stage.cache.total_bytes <= stage.device_bytes
        kda_layers = [config.layer_types[i] for i in stage.layers].count("kda")
        assert stage.cache.slot_bytes >= kda_layers * (config.kda.num_heads // 2) * config.kda.head_dim_k \
            * config.kda.head_dim_v * 4


def test_full_scale_sequence_table_matches_the_design_facts():
    config = ModelConfig.from_preset("k3-2.8t")
    assert gqa_reference_bytes(1_000_000) == pytest.approx(163.84e9)
    fp8 = per_sequence_bytes(config, 1_000_000, "fp8")
    assert fp8["dsa_latent"] == 24 * 1_000_000 * 656  # 24 DSA layers x (512 e4m3 + 4 fp32 scales + 64 bf16 rope)
    assert fp8["dsa_index"] == 24 * 1_000_000 * 132  # 128 e4m3 + 1 fp32 scale
    assert fp8["kda_state"] == 69 * 96 * 128 * 128 * 4  # constant in sequence length
    assert per_sequence_bytes(config, 10, "fp8")["kda_state"] == fp8["kda_state"]
    assert sum(fp8.values()) < gqa_reference_bytes(1_000_000) / 8  # 19.4 GB against 163.8 GB
