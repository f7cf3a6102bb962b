"""ServiceConfig validation, the shipped configs, and planner bytes == allocated bytes (docs/design.md §6.1, §6.2)."""
import re
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
    ({"memory": {"prefix_cache": {"snapshot_slots": -1}}}, "memory.prefix_cache.snapshot_slots: must be an integer"),
    ({"memory": {"device": "TPU"}}, "memory.device: must be one of"),
    ({"memory": {"max_num_seqs": 64}, "scheduler": {"max_batch_size": 8}}, "scheduler.max_batch_size: \\(8\\) must be >="),
    ({"model": {"preset": "huge"}}, "model.preset: must be one of"),
    ({"model": {"preset": "tiny", "checkpoint": "ckpt/"}}, "model.checkpoint: give model.preset or"),
    ({"model": {"max_model_len": -1}}, "model.max_model_len: must be >= 2"),
    ({"model": {"max_model_len": 1}}, "model.max_model_len: must be >= 2"),
    ({"model": {"name": ""}}, "model.name: must not be empty"),
    ({"model": {"checkpoint": ""}}, "model.checkpoint: must not be empty"),
    ({"model": {"seed": -1}}, "model.seed: must be an integer in \\[0, 2\\^63\\)"),
    ({"model": {"seed": 2 ** 64}}, "model.seed: must fit in int64"),
    ({"memory": {"cache_bytes": 2 ** 64}}, "memory.cache_bytes: must fit in int64"),
    ({"scheduler": {"max_log_records": 10 ** 12}}, "scheduler.max_log_records: must be a positive integer, at most"),
    ({"parallel": {"tensor_parallel_size": 0}}, "parallel.tensor_parallel_size: must be a positive integer"),
    ({"parallel": {"group_timeout_s": 0}}, "parallel.group_timeout_s: must be a number of seconds in \\[0.1, 3600\\]"),
    ({"parallel": {"group_timeout_s": 0.001}}, "parallel.group_timeout_s: must be a number of seconds in \\[0.1"),
    ({"parallel": {"group_timeout_s": -1.5}}, "parallel.group_timeout_s: must be a number of seconds"),
    ({"parallel": {"group_timeout_s": float("inf")}}, "parallel.group_timeout_s: must be a finite number"),
    ({"parallel": {"group_timeout_s": float("nan")}}, "parallel.group_timeout_s: must be a finite number"),
    ({"parallel": {"group_timeout_s": "30s"}}, "parallel.group_timeout_s: expected float"),
    ({"parallel": {"group_timeout_s": True}}, "parallel.group_timeout_s: expected float"),
    ({"serving": {}}, "serving: unknown section"),
    ({"memory": [1, 2]}, "memory: expected a mapping"),
    ({"memory": []}, "memory: expected a mapping"),
    ({"memory": 0}, "memory: expected a mapping"),
    ({"scheduler": False}, "scheduler: expected a mapping"),
    ({"model": ""}, "model: expected a mapping"),
])
def test_validation_names_the_key_path(data, message):
    with pytest.raises(ValueError, match=message):
        ServiceConfig.from_dict(data)


def test_group_timeout_reaches_the_worker_layout():
    from latentmoe_lab.serving.config import serving_layout

    assert ServiceConfig.from_dict({}).parallel.group_timeout_s == 30.0
    service = ServiceConfig.from_dict({"parallel": {"tensor_parallel_size": 2, "group_timeout_s": 7}})
    assert serving_layout(ModelConfig.from_preset("tiny"), service.parallel).timeout_s == 7.0


def test_from_yaml_refuses_a_missing_file(tmp_path):
    with pytest.raises(ValueError, match="path"):
        ServiceConfig.from_yaml(tmp_path / "nope.yaml")


def service(kv_cache_dtype="auto", prefix=True, block=16, budget=1_000_000, max_len=256):
    return ServiceConfig.from_dict({
        "model": {"max_model_len": max_len},
        "memory": {"cache_bytes": budget, "block_size": block, "max_num_seqs": 3, "kv_cache_dtype": kv_cache_dtype,
                   **({"prefix_cache": {"snapshot_slots": 5}} if prefix else {})}})


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
    shared = config.replace(dsa={**config.to_dict()["dsa"], "index_share_every": 2})  # 12 layers keep index keys
    assert per_sequence_bytes(shared, 1_000_000, "fp8")["dsa_index"] == 12 * 1_000_000 * 132


# --- service files: the loader `serve` and `plan-service` share, and what it refuses at load ---

CPU_YAML = (CONFIGS / "service-cpu.yaml").read_text()


def _write(tmp_path, text, name="s.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("value", ["''", "0", "false", "[]", "'x'"])
def test_a_section_that_is_not_a_mapping_is_refused_naming_file_and_section(tmp_path, value):
    from latentmoe_lab.server.settings import load_service_file

    path = _write(tmp_path, re.sub(r"memory:\n(  .*\n)+", f"memory: {value}\n", CPU_YAML))
    for load in (load_service_file, ServiceConfig.from_yaml):
        with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: memory: expected a mapping of keys"):
            load(path)


def test_an_empty_section_takes_defaults_but_a_list_or_scalar_file_is_refused(tmp_path):
    assert ServiceConfig.from_yaml(_write(tmp_path, "model: {preset: tiny}\nmemory:\n")).memory.block_size == 64
    for text, shown in [("[]\n", "list"), ("- model\n", "list"), ("hello\n", "'hello'")]:
        with pytest.raises(ValueError, match=rf"a service file is a mapping of sections .*, got {shown}"):
            ServiceConfig.from_yaml(_write(tmp_path, text))
    with pytest.raises(ValueError, match=r"line 1, column 1: mapping keys must be strings"):
        ServiceConfig.from_yaml(_write(tmp_path, "1: a\nnull: b\n"))
    with pytest.raises(ValueError, match=r"s\.yaml, line 23, column 3: not valid YAML"):  # the newcomer's case
        ServiceConfig.from_yaml(_write(tmp_path, CPU_YAML.replace("block_size: 64", "block_size: [64")))


def test_plan_service_accepts_the_server_section_serve_accepts(tmp_path, capsys):
    from latentmoe_lab.cli import main
    from latentmoe_lab.server.settings import engine_config_from_yaml

    path = _write(tmp_path, CPU_YAML + "server:\n  max_retries: 2\n  step_timeout_s: 60\n")
    assert ServiceConfig.from_yaml(path) == ServiceConfig.from_yaml(CONFIGS / "service-cpu.yaml")
    assert main(["plan-service", str(path)]) == 0
    assert "on a CPU (serve, serve-bench): memory.cache_bytes 268.44 MB" in capsys.readouterr().out
    bad = _write(tmp_path, CPU_YAML + "server:\n  max_retrys: 2\n", "bad.yaml")
    with pytest.raises(ValueError, match=r"bad\.yaml: server\.max_retrys: unknown key"):
        engine_config_from_yaml(bad)  # plan-service's and serve-bench's loader (server/settings.py)


@pytest.mark.parametrize("ep", [7, 16, 10 ** 12])
def test_plans_refuse_expert_parallel_sizes_the_experts_do_not_split_into(ep):
    svc = ServiceConfig.from_dict({"parallel": {"expert_parallel_size": ep}, "memory": {"max_num_seqs": 8}})
    with pytest.raises(ValueError, match=rf"^parallel\.expert_parallel_size: {ep} must divide moe\.num_experts \(8\)"):
        plan_service(svc, ModelConfig.from_preset("tiny"))


def test_sizes_serve_would_die_on_are_refused_at_load(tmp_path, monkeypatch):
    from latentmoe_lab.server.settings import load_service_file
    from latentmoe_lab import threads
    from latentmoe_lab.serving import host_limits
    from latentmoe_lab.serving.service_plan import load_service_config

    monkeypatch.setattr(host_limits, "available_memory_bytes", lambda: 200_000_000)
    monkeypatch.setattr(threads, "affinity_cores", lambda: 2)  # read by threads.check_within_cores
    fits = CPU_YAML.replace("268435456", "150000000")
    assert load_service_file(_write(tmp_path, fits))[0].memory.cache_bytes == 150_000_000  # kept as it is
    cases = [("cache_bytes: 150000000", "cache_bytes: 268435456",
              r"memory\.cache_bytes: 268435456 \(268\.44 MB\) exceeds the 200\.00 MB of memory available"),
             ("forward_process: true", "forward_process: true\n  forward_threads: 3",
              r"parallel\.forward_threads: 3 exceeds the 2 cores this process may run on"),
             ("snapshot_slots: 32 ", "snapshot_slots: 1000000000 ",
              r"memory\.cache_bytes: 150000000 bytes cannot hold the 1000000032 KDA slots"),
             ("prefill_chunk_size: 512", "prefill_chunk_size: 512\n  max_log_records: 1000000000000",
              r"scheduler\.max_log_records: must be a positive integer, at most 1000000"),
             ("forward_process: true", "forward_process: true\n  group_timeout_s: 0.001",
              r"parallel\.group_timeout_s: must be a number of seconds in \[0\.1, 3600\]"),
             ("seed: 0 ", "seed: 18446744073709551616 ", r"model\.seed: must fit in int64")]
    for old, new, message in cases:
        path = _write(tmp_path, fits.replace(old, new))
        for load in (load_service_file, load_service_config):  # serve's loader, the engine's (service_plan.py)
            with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: {message}"):
                load(path)
    ep2tp2 = (CONFIGS / "service-cpu-ep2tp2.yaml").read_text().replace("67108864", "60000000")
    with pytest.raises(ValueError, match=r"60000000 \(60\.00 MB\) on each of 4 ranks exceeds the 200\.00 MB"):
        load_service_file(_write(tmp_path, ep2tp2))


def test_error_messages_show_at_most_200_characters_of_a_value():
    from latentmoe_lab.server.settings import ServerSettings

    nested = [[list(range(100))] * 100] * 100
    for make in (lambda: ServiceConfig.from_dict({"model": {"name": nested}}),
                 lambda: ServiceConfig.from_dict({"memory": {"kv_cache_dtype": "x" * 10_000}}),
                 lambda: ServerSettings(max_retries=nested),
                 lambda: ServiceConfig.from_dict({"memory": {"k" * 100_000: 1}}),
                 lambda: ServiceConfig.from_dict({"x" * 100_000: {}}),
                 lambda: ServerSettings.from_dict({"k" * 100_000: 1}),
                 lambda: ModelConfig.from_dict({"k" * 100_000: 1})):
        with pytest.raises(ValueError) as caught:
            make()
        assert len(str(caught.value)) < 300


def test_a_cpu_engine_without_cache_bytes_takes_a_stated_share_of_available_memory(monkeypatch, caplog, tmp_path):
    """Seed-style YAML (the public example's keys, a preset, no cache_bytes) runs as it is."""
    from latentmoe_lab.serving import Engine, SamplingParams, host_limits
    from latentmoe_lab.serving.planner import pools_bytes, with_cache_budget
    from latentmoe_lab.serving.service_plan import service_plan_text
    from latentmoe_lab.model import LatentMoEForCausalLM

    monkeypatch.setattr(host_limits, "available_memory_bytes", lambda: 300_000_000)
    path = _write(tmp_path, "model: {name: tiny-moe, max_model_len: 256, dtype: fp32, preset: tiny}\n"
                            "memory: {max_num_seqs: 2, block_size: 16, prefix_cache: {}}\n"
                            "scheduler: {max_batch_size: 4, prefill_chunk_size: 64}\n")
    svc = ServiceConfig.from_yaml(path)
    assert svc.memory.cache_bytes is None
    config = ModelConfig.from_preset("tiny")
    assert "10% of the 300.00 MB available, at most 4.29 GB: 30.00 MB of cache pools per rank" \
        in service_plan_text(svc, config)
    model = LatentMoEForCausalLM(config).eval()
    with caplog.at_level("WARNING", logger="latentmoe_lab.serving.planner"):
        engine = Engine(model, svc)
    assert engine.plan.budget == 30_000_000 and "30.00 MB of cache pools per rank" in caplog.text
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [len(out.token_ids) for out in outputs if out.finished] == [2]
    # without prefix caching, no more than every running sequence can fill; explicit values and GPUs untouched
    plain = ServiceConfig.from_dict({"model": {"max_model_len": 256}, "memory": {"max_num_seqs": 2, "block_size": 16}})
    assert with_cache_budget(config, plain).memory.cache_bytes == pools_bytes(config, plain, 2 * 16, 2)
    given = ServiceConfig.from_dict({"memory": {"cache_bytes": 12345}})
    assert with_cache_budget(config, given) is given and with_cache_budget(config, plain, "meta") is plain
