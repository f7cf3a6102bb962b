"""The cache hierarchy configured in one place (serving/cache_tiers/cache_section.py, docs/design.md §6.1):
memory.prefix_cache and memory.offload, `enabled: false` sections (speculative: and disaggregation: too), and the
deprecated keys they replace: same ServiceConfig, one FutureWarning each, refusals naming the keys."""
import dataclasses
import warnings
from pathlib import Path

import pytest

from latentmoe_lab.serving import Engine, ServiceConfig
from latentmoe_lab.serving.block_manager import BlockManager
from latentmoe_lab.serving.cache_tiers.cache_section import OffloadSection, PrefixCacheSection
from latentmoe_lab.serving.config import MemorySection
from latentmoe_lab.serving.disagg.section import role_config
from latentmoe_lab.serving.planner import plan_cache

CONFIGS = Path(__file__).parents[1] / "configs"
MEMORY = {"max_num_seqs": 2, "block_size": 16, "cache_bytes": 3_000_000}
BASE = {"model": {"max_model_len": 512}, "scheduler": {"max_batch_size": 4, "prefill_chunk_size": 64}}


def load(data: dict) -> tuple[ServiceConfig, list[str]]:
    """The config of `data` and the FutureWarnings its loading emitted (every one, none deduplicated)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = ServiceConfig.from_dict(data)
    assert all(issubclass(w.category, FutureWarning) for w in caught), [str(w.message) for w in caught]
    return config, [str(w.message) for w in caught]


def with_memory(memory: dict, **sections) -> dict:
    return BASE | {"memory": MEMORY | memory} | sections


@pytest.mark.parametrize("old, new", [
    (with_memory({"enable_prefix_caching": True}), with_memory({"prefix_cache": {}})),
    (with_memory({"enable_prefix_caching": True, "prefix_snapshot_slots": 4}),
     with_memory({"prefix_cache": {"enabled": True, "snapshot_slots": 4}})),
    (with_memory({"enable_prefix_caching": True, "prefix_snapshot_slots": 1},
                 prefix_cache={"host_bytes": 1_000_000, "disk_dir": "/tmp/x", "disk_bytes": 10 ** 9}),
     with_memory({"prefix_cache": {"snapshot_slots": 1, "host_bytes": 1_000_000, "disk_dir": "/tmp/x",
                                   "disk_bytes": 10 ** 9}})),
    (with_memory({"enable_prefix_caching": False}), with_memory({})),  # the old default: off
    (with_memory({"enable_prefix_caching": False, "prefix_snapshot_slots": 0}, prefix_cache={"host_bytes": 0}),
     with_memory({})),
    (with_memory({}, prefix_cache=None), with_memory({})),
], ids=["enabled", "slots", "spill-tiers", "off", "off-with-zeros", "empty-tiers"])
def test_old_keys_load_to_the_new_keys_config_with_one_warning_each(old, new):
    old_config, messages = load(old)
    new_config, none = load(new)
    assert old_config == new_config and none == []
    given = [key for key in ("enable_prefix_caching", "prefix_snapshot_slots") if key in old["memory"]]
    given += ["prefix_cache"] if "prefix_cache" in old else []
    replacement = {"enable_prefix_caching": "memory.prefix_cache.enabled",
                   "prefix_snapshot_slots": "memory.prefix_cache.snapshot_slots", "prefix_cache": "memory.prefix_cache"}
    assert messages == [f"{'' if key == 'prefix_cache' else 'memory.'}{key} is deprecated: use {replacement[key]}"
                        for key in given]
    assert all("\n" not in message for message in messages)
    assert ServiceConfig.from_dict(old_config.to_dict()) == old_config  # the round trip is in the new keys
    assert "enable_prefix_caching" not in old_config.to_dict()["memory"] and "prefix_cache" not in old_config.to_dict()


def test_an_old_key_file_on_disk_loads_like_the_new_one(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("memory: {max_num_seqs: 2, enable_prefix_caching: true, prefix_snapshot_slots: 3}\n"
                   "prefix_cache: {host_bytes: 1000}\n")
    new = tmp_path / "new.yaml"
    new.write_text("memory:\n  max_num_seqs: 2\n  prefix_cache:\n    snapshot_slots: 3\n    host_bytes: 1000\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ServiceConfig.from_yaml(old) == ServiceConfig.from_yaml(new)
    assert [str(w.message).split(" is deprecated")[0] for w in caught] == [
        "memory.enable_prefix_caching", "memory.prefix_snapshot_slots", "prefix_cache"]


@pytest.mark.parametrize("data, old, new", [
    (with_memory({"enable_prefix_caching": True, "prefix_cache": {}}),
     "memory.enable_prefix_caching", "memory.prefix_cache.enabled"),
    (with_memory({"prefix_snapshot_slots": 2, "prefix_cache": {"snapshot_slots": 2}}),
     "memory.prefix_snapshot_slots", "memory.prefix_cache.snapshot_slots"),
    (with_memory({"prefix_cache": {"host_bytes": 10}}, prefix_cache={"host_bytes": 10}),
     "prefix_cache", "memory.prefix_cache"),
])
def test_an_old_key_given_with_its_new_key_is_an_error_naming_both(data, old, new):
    with pytest.raises(ValueError) as caught:
        load(data)
    message = str(caught.value)
    assert message.startswith(f"{old}: deprecated") and new in message


@pytest.mark.parametrize("data, message", [  # moved here from test_serving_config / test_prefix_spill
    (with_memory({"prefix_snapshot_slots": 4}),
     "memory.prefix_snapshot_slots: serves prefix caching only, .* set memory.prefix_cache.enabled true"),
    (with_memory({"enable_prefix_caching": False, "prefix_snapshot_slots": 0}, prefix_cache={"host_bytes": 10}),
     "prefix_cache.host_bytes: serves prefix caching only, .*memory.enable_prefix_caching"),
    (with_memory({"enable_prefix_caching": True, "prefix_snapshot_slots": 0}, prefix_cache={"disk_dir": "x"}),
     r"memory.prefix_cache.disk_dir: needs memory.prefix_cache.snapshot_slots >= 1"),
    (with_memory({"enable_prefix_caching": True}, prefix_cache={"host_bytes": -1}),
     "memory.prefix_cache.host_bytes: must be an integer >= 0"),
    (with_memory({"enable_prefix_caching": "yes"}), "memory.prefix_cache.enabled: expected bool"),
    (with_memory({"enable_prefix_caching": True}, prefix_cache=5), "prefix_cache: expected a mapping"),
])
def test_old_keys_are_refused_as_before_naming_the_keys(data, message):
    with pytest.raises(ValueError, match=message):
        load(data)


@pytest.mark.parametrize("data, message", [
    (with_memory({"prefix_cache": 5}), "memory.prefix_cache: expected a mapping of keys"),
    (with_memory({"prefix_cache": {"enabled": "yes"}}), "memory.prefix_cache.enabled: expected bool"),
    (with_memory({"prefix_cache": {"snapshots": 2}}), "memory.prefix_cache.snapshots: unknown key"),
    (with_memory({"prefix_cache": {"snapshot_slots": 0, "host_bytes": 10}}),
     r"memory.prefix_cache.host_bytes: needs memory.prefix_cache.snapshot_slots >= 1"),
    (with_memory({"prefix_cache": {"disk_bytes": 0, "disk_dir": "x"}}),
     "memory.prefix_cache.disk_bytes: must be a positive integer"),
    (with_memory({"prefix_cache": {"enabled": False, "host_bytes": "1 GB"}}),  # off: names and types still checked
     "memory.prefix_cache.host_bytes: expected int"),
    (with_memory({"offload": {"enabled": True}}), "memory.offload.host_cache_bytes: required with memory.offload"),
    (with_memory({"offload": {"enabled": 0, "host_cache_bytes": 10}}), "memory.offload.enabled: expected bool"),
    (with_memory({"offload": {"host_cache_bytes": 10, "hot_rows_per_layer": 0}}),
     "memory.offload.hot_rows_per_layer: must be a positive integer"),
    (BASE | {"speculative": {"enabled": "no", "method": "ngram"}}, "speculative.enabled: expected bool"),
    (BASE | {"speculative": {"enabled": True, "num_speculative_tokens": 2}},
     "speculative.method: required when the section sets num_speculative_tokens"),
    (BASE | {"disaggregation": {"enabled": 1, "prefill_instances": 1}}, "disaggregation.enabled: expected bool"),
    (BASE | {"disaggregation": {"prefill_instances": 1}}, "disaggregation.decode_instances: must be a positive"),
])
def test_each_refusal_names_the_key(data, message):
    with pytest.raises(ValueError, match=message):
        load(data)


def plan_numbers(plan) -> dict:
    """A CachePlan's counts and bytes (its formats are objects without equality)."""
    numbers = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)
               if isinstance(getattr(plan, f.name), int)}
    return numbers | {"bytes_by_kind": plan.bytes_by_kind(), "total_bytes": plan.total_bytes}


def test_sections_with_enabled_false_are_off_and_allocate_nothing(model, tmp_path):
    """Every section present but off: the same flags, the same plan and the same engine as a file without them;
    what an off section would have set up (a spill directory, a host tier, a drafter) is not."""
    off = with_memory({"prefix_cache": {"enabled": False, "snapshot_slots": 8, "host_bytes": -1,
                                        "disk_dir": str(tmp_path / "spill")},  # values unchecked while off
                       "offload": {"enabled": False, "host_cache_bytes": 1}},
                      speculative={"enabled": False, "method": "ngram", "num_speculative_tokens": 3},
                      disaggregation={"enabled": False, "prefill_instances": 1, "decode_instances": 1})
    absent = with_memory({})
    off_config, messages = load(off)
    absent_config, _ = load(absent)
    assert messages == []
    mem = off_config.memory
    assert not (mem.prefix_cache.enabled or mem.prefix_cache.spills or mem.offload.enabled)
    assert mem.snapshot_slots == 0 and not off_config.speculative.enabled and not off_config.disaggregation.enabled
    assert ServiceConfig.from_dict(off_config.to_dict()) == off_config  # `enabled: false` survives the round trip
    assert plan_numbers(plan_cache(model.config, off_config)) == plan_numbers(plan_cache(model.config, absent_config))
    engines = [Engine(model, config) for config in (off_config, absent_config)]
    assert plan_numbers(engines[0].plan) == plan_numbers(engines[1].plan)
    assert all(type(engine.block_manager) is BlockManager and not engine.block_manager.enable_prefix_caching
               and engine.speculator is None and not engine.runner.pools.offloaded for engine in engines)
    assert engines[0].stats().keys() == engines[1].stats().keys()
    assert not (tmp_path / "spill").exists()
    for engine in engines:
        engine.close()


def test_an_absent_section_and_null_are_the_same_and_python_callers_get_sections():
    assert load(with_memory({"prefix_cache": None, "offload": None}))[0] == load(with_memory({}))[0]
    assert load(with_memory({}, speculative={}, disaggregation={}))[0] == load(with_memory({}))[0]
    memory = MemorySection(prefix_cache=PrefixCacheSection(snapshot_slots=3), offload={"host_cache_bytes": 10})
    assert memory.snapshot_slots == 3 and memory.offload == OffloadSection(host_cache_bytes=10)
    assert MemorySection(prefix_cache={}).snapshot_slots == MemorySection().max_num_seqs
    plain = dataclasses.replace(memory, prefix_cache=None, offload=None)
    assert plain.snapshot_slots == 0 and not plain.offload.enabled


def test_a_role_override_with_an_old_key_changes_that_role_only():
    common = with_memory({"prefix_cache": {"snapshot_slots": 4}})
    old = common | {"disaggregation": {"prefill_instances": 1, "decode_instances": 1,
                                       "decode": {"memory": {"enable_prefix_caching": False}}}}
    new = common | {"disaggregation": {"prefill_instances": 1, "decode_instances": 1,
                                       "decode": {"memory": {"prefix_cache": {"enabled": False, "snapshot_slots": 4}}}}}
    old_config, messages = load(old)
    assert old_config == load(new)[0]
    assert messages == ["disaggregation.decode.memory.enable_prefix_caching is deprecated: "
                        "use disaggregation.decode.memory.prefix_cache.enabled"]
    assert role_config(old_config, "prefill").memory.snapshot_slots == 4
    assert not role_config(old_config, "decode").memory.prefix_cache.enabled


def test_shipped_configs_use_the_new_keys_and_load_without_a_warning():
    for path in sorted(CONFIGS.glob("*.yaml")):
        text = path.read_text()
        assert "enable_prefix_caching" not in text and "prefix_snapshot_slots" not in text, path
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ServiceConfig.from_yaml(path)
        assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == [], path
