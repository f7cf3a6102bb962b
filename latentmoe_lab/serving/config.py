"""ServiceConfig: the YAML file that describes one serving deployment (docs/design.md §6.1).

Six sections, the keys of the public example first, then ours where the example is silent:

    model:
      name                  str    label only (not empty)
      max_model_len         int    prompt + generated tokens of one request, at most (>= 2)
      dtype                 str    weights: fp32 | bf16 | fp16 | fp8 (fp8 = routed experts in block-scaled
                                   FP8, everything else bf16, as meta.py counts it; planning only on a CPU)
      preset                str    ours: a ModelConfig preset ("tiny", "small", "k3-2.8t")
      checkpoint            str    ours: a directory written by save_pretrained (exclusive with preset)
      checkpoint_if_present str    ours: a save_pretrained directory `serve` runs instead of preset when it
                                   exists (server/loading.py; needs preset, the model served without it)
      seed                  int    ours: seed of the random weights when a preset is built, in [0, 2^63)
                                   (default 0)
    parallel:
      tensor_parallel_size, expert_parallel_size, pipeline_parallel_size   int >= 1
                                   (> 1: the engine's forward runs on that many worker processes;
                                   plan-service plans them at full scale)
      forward_process       bool   ours: with every size 1, run the forward in one worker process anyway
                                   (default false). A server sets it: its engine thread then waits on a
                                   pipe instead of holding the GIL that the HTTP event loop needs
      forward_threads       int    ours: torch threads of that process (default 0: as many as the process
                                   that builds the Engine uses; `latentmoe-lab serve --threads` sets it);
                                   a file may not ask for more than the cores this process may run on
      group_timeout_s       float  ours: seconds in [0.1, 3600], the timeout of every worker process group
                                   (default 30.0): a rank that hangs is detected within it, so a pipeline
                                   stage's part of a step must finish within it (its successor waits so long)
      role                  str    ours: colocated (default: one engine prefills and decodes) | prefill |
                                   decode (an instance of a disaggregated service; `serve` sets it on the
                                   instances it starts from the disaggregation: section)
    memory:
      kv_cache_dtype        str    auto (= model dtype) | fp32 | bf16 | fp16 | fp8: the MLA latent pool
      index_key_dtype       str    ours: auto (the indexer keys in kv_cache_dtype's format) | int4 | fp4: 4-bit keys,
                                   fp16 scales per 32 channels (quant/kv_index4.py; not with disaggregation: or a
                                   prefix_cache spill tier, whose row transfers know the other layouts only)
      state_dtype           str    ours: fp32 | bf16 | int8 (error feedback): KDA state, conv tail (quant/kda_state.py)
      gpu_memory_utilization float in (0, 1]: share of device memory for weights + caches (plan-service)
      enable_paged_attention bool  must be true: the engine has only the paged path
      max_num_seqs          int    sequences holding cache at once = KDA state slots
      block_size            int    ours: tokens per cache block (default 64)
      cache_bytes           int    ours: the CPU budget for every cache pool of one rank, in bytes; at most
                                   the host's available memory over all ranks. Left out, an Engine on a
                                   CPU takes 10% of the available memory, at most 4 GiB, split over the
                                   ranks (serving/host_limits.py; logged, and shown by plan-service)
      device                str    ours: hardware of plan-service, a key of parallel.hardware.HARDWARE
                                   (default H200-141GB)
      prefix_cache          map    ours: prefix caching, hash-chained block sharing + KDA state snapshots,
                                   and the host / disk tiers evicted blocks spill to (enabled, snapshot_slots,
                                   host_bytes, disk_dir, disk_bytes; docs/design.md §6.5, §15.3)
      offload               map    ours: DSA latent rows in a host tier, top-k rows swapped into a device hot
                                   buffer per sequence (enabled, host_cache_bytes, hot_rows_per_layer; §15.1)
                                   Both: absent or null: off; a mapping: on unless `enabled: false`;
                                   serving/cache_tiers/cache_section.py lists the keys and the deprecated ones
    scheduler:
      max_batch_size        int    the queue's capacity: requests held, waiting + running; past it a request is
                                   refused ("queue full"). Not a batch size: memory.max_num_seqs bounds a step's
                                   sequences (vLLM's max_num_seqs), prefill_chunk_size its tokens
      chunked_prefill       bool   false: a prompt is prefilled whole in one step (it may overrun the budget)
      prefill_chunk_size    int    the token budget of a whole step, decodes (one token each) and prefill chunks
                                   together (vLLM's max_num_batched_tokens), not the size of one chunk
      max_step_retries      int    ours: failed steps a request may be retried after, once a failure is
                                   pinned on it alone (docs/design.md §6.5); one more and it fails alone
                                   with error "engine_step_failed" (default 3; a server sets server.max_retries)
      max_log_records       int    ours: Engine.log keeps the latest this many step and request records,
                                   at most 1000000 (default 100000; a server keeps fewer)
      batch_invariant       bool   ours: a request's logits bit for bit independent of its step-mates, the
                                   budget and prefix hits (serving/invariance.py; default false: it costs
                                   budget at chunk ends and 13-21% of the engine's throughput on the CPU)
    eplb:                          ours: expert-parallel load balancing (parallel/eplb/online.py, design §14)
      enabled               bool   redundant expert slots and online migration on the EP workers (default
                                   false; needs parallel.expert_parallel_size > 1)
      num_redundant_experts int    extra slots per MoE layer, >= 0; experts + it must divide by the EP size
      window_steps          int    steps of routed-token counts the balancer (and /metrics) looks at (32)
      rebalance_interval_steps int a new placement every this many steps (64)
      layers_per_step       int    MoE layers whose slots migrate with one step (1)
    speculative:                   speculative decoding (docs/design.md §12; absent, empty or no method: off)
      enabled               bool   ours: false keeps the section but turns it off (default true)
      method                str    ngram (prompt lookup in the request's own tokens) | mtp (the model's MTP
                                   head, config.mtp_depth > 0, checked when the engine starts)
      num_speculative_tokens int   K, draft tokens per step and sequence, 1..8 (required with method)
      prompt_lookup_min     int    ngram only: the shortest suffix matched, >= 1 (default 1)
      prompt_lookup_max     int    ngram only: the longest, >= prompt_lookup_min (default 4)
      adaptive              bool   ours: k per sequence and step in 0..K from its recent acceptance
                                   (spec/draft_count.py; default false: always K)
      draft_cost            float  with adaptive: a draft token's cost in plain decode steps, (0, 10] (0.25)
      probe_interval        int    with adaptive: steps at k = 0 before a one-draft probe, >= 1 (8)
      max_context           int    no drafts for a sequence longer than this many tokens, >= 1 (no limit)
    disaggregation:                ours: prefill/decode disaggregation (serving/disagg/, docs/design.md §13;
                                   absent: one colocated engine)
      enabled               bool   false keeps the section but serves colocated (default true)
      prefill_instances     int    prefill instance processes, >= 1
      decode_instances      int    decode instance processes, >= 1
      transport             str    pipe: a Unix socket pair per instance, through the router (loopback only)
      prefill, decode       map    per-role overrides of model / parallel / memory / scheduler keys
                                   ({memory: {cache_bytes: ...}}); weights and cache dtype must agree

A file is read by latentmoe_lab/yaml_loader.py (no anchors, aliases, tags or duplicate keys; ints are
plain decimals; errors name the file, line and column). A section may be left empty (`memory:` alone:
defaults); any other value that is not a mapping ('', 0, false, []) is an error naming the section, as
is a file that is not a mapping. Unknown keys, wrong types and inconsistent values raise ValueError
naming the key path, showing values at most 200 characters long (config_fields.describe). Loading a
file through service_plan.load_service_config (or server/settings.py's loaders, which also check the optional
`server:` section) checks the engine's layout and cache plan when model.preset is given
(service_plan.check_engine_plan) and the sizes this host cannot run (serving/host_limits.py); from_yaml
here parses and validates the file alone.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from latentmoe_lab.config_fields import (check, check_choice, check_field_types, check_positive_int, describe,
                                         key_name, section_from_dict)
from latentmoe_lab.serving.cache_tiers.cache_section import (OffloadSection, PrefixCacheSection, cache_section,
                                                             check_spill_snapshots, upgrade_cache_keys)
from latentmoe_lab.serving.disagg.section import DisaggregationSection, check_disaggregation
from latentmoe_lab.serving.spec.section import SpeculativeSection, check_speculative
from latentmoe_lab.yaml_loader import errors_name_file, file_label, read_yaml_file

WEIGHT_DTYPES = ("fp32", "bf16", "fp16", "fp8")
CACHE_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8", "int8")
INDEX_KEY_DTYPES = ("auto", "int4", "fp4")  # quant/kv.py's (tests/test_index_keys.py checks they agree)
STATE_DTYPES = ("fp32", "bf16", "int8")  # quant/kda_state.py's (tests/test_state_dtype.py checks they agree)
LAYOUT_KEYS = {"tp": "tensor_parallel_size", "ep": "expert_parallel_size", "pp": "pipeline_parallel_size"}
MIN_MODEL_LEN = 2  # one prompt token and one generated token
MIN_GROUP_TIMEOUT_S = 0.1  # shorter, and a worker group cannot even form (gloo's rendezvous takes longer)
MAX_EPLB_WINDOW_STEPS = 100_000  # the window holds steps x MoE layers x experts int64 counters
MAX_EPLB_SLOTS = 8192  # parallel/eplb/rebalance.py's MAX_SLOTS_PER_LAYER: the model's check then narrows it
MAX_LOG_RECORDS = 1_000_000  # Engine.log's records take a few hundred bytes each: a few hundred MB at most


@dataclass
class ModelSection:
    name: str = "latentmoe"
    max_model_len: int = 4096
    dtype: str = "fp32"
    preset: str | None = None
    checkpoint: str | None = None
    checkpoint_if_present: str | None = None
    seed: int = 0


@dataclass
class ParallelSection:
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    forward_process: bool = False
    forward_threads: int = 0
    group_timeout_s: float = 30.0
    role: str = "colocated"


@dataclass
class MemorySection:
    kv_cache_dtype: str = "auto"
    index_key_dtype: str = "auto"
    state_dtype: str = "fp32"
    gpu_memory_utilization: float = 0.9
    enable_paged_attention: bool = True
    max_num_seqs: int = 16
    block_size: int = 64
    cache_bytes: int | None = None
    device: str = "H200-141GB"
    # the cache tiers: a mapping from the file, a section or None -> a checked section (None -> one with enabled
    # false; serving/cache_tiers/cache_section.py)
    prefix_cache: PrefixCacheSection | None = None
    offload: OffloadSection | None = None

    def __post_init__(self) -> None:
        self.prefix_cache = cache_section(PrefixCacheSection, self.prefix_cache)
        self.offload = cache_section(OffloadSection, self.offload)

    @property
    def snapshot_slots(self) -> int:
        """KDA snapshot slots the pools hold besides the max_num_seqs running slots (0 without prefix caching)."""
        slots = self.prefix_cache.snapshot_slots
        return 0 if not self.prefix_cache.enabled else self.max_num_seqs if slots is None else slots


@dataclass
class SchedulerSection:
    max_batch_size: int = 64  # the queue's capacity (waiting + running requests), not a step's batch
    chunked_prefill: bool = True
    prefill_chunk_size: int = 512  # one step's token budget, decodes included (vLLM's max_num_batched_tokens)
    max_step_retries: int = 3
    max_log_records: int = 100_000
    batch_invariant: bool = False


@dataclass
class EplbSection:
    enabled: bool = False
    num_redundant_experts: int = 0
    window_steps: int = 32
    rebalance_interval_steps: int = 64
    layers_per_step: int = 1


SECTIONS = {"model": ModelSection, "parallel": ParallelSection, "memory": MemorySection,
            "scheduler": SchedulerSection, "eplb": EplbSection, "speculative": SpeculativeSection,
            "disaggregation": DisaggregationSection}
OUTER_SECTIONS = ("server",)  # the HTTP service's section of a service file: server/settings.py checks it


@dataclass
class ServiceConfig:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    memory: MemorySection = field(default_factory=MemorySection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    eplb: EplbSection = field(default_factory=EplbSection)
    speculative: SpeculativeSection = field(default_factory=SpeculativeSection)
    disaggregation: DisaggregationSection = field(default_factory=DisaggregationSection)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ServiceConfig":
        if not isinstance(data, dict):
            raise ValueError(f"service config: expected a mapping of sections, got {describe(data)}")
        data = upgrade_cache_keys(data)  # the deprecated cache keys, moved with a FutureWarning each
        unknown = sorted(str(key) for key in set(data) - set(SECTIONS))
        if unknown:
            raise ValueError(f"{key_name(unknown[0])}: unknown section; expected some of {list(SECTIONS)}")
        config = cls(**{name: section_from_dict(section_cls, section_values(data, name), name)  # then validate()
                        for name, section_cls in SECTIONS.items()})
        config.validate()
        return config

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ServiceConfig":
        """The engine's part of a service file, parsed and validated (errors name the file). Sections of the layers
        above (OUTER_SECTIONS: `server:`) are left to them. What `serve` would refuse at start (the engine's plan,
        the host's limits) is checked by service_plan.load_service_config, which reads the file through this."""
        return cls.from_file_data(read_service_file(path, "path"), path)

    @classmethod
    def from_file_data(cls, data: dict[str, Any], path: str | Path) -> "ServiceConfig":
        """from_yaml of a file already read (read_service_file)."""
        with errors_name_file(path):
            return cls.from_dict({key: value for key, value in data.items() if key not in OUTER_SECTIONS})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(self) -> None:
        m, p, mem, s = self.model, self.parallel, self.memory, self.scheduler
        for name in SECTIONS:
            check_field_types(getattr(self, name), prefix=f"{name}.")
        check(m.name.strip() != "", "model.name", "must not be empty")
        check(m.max_model_len >= MIN_MODEL_LEN, "model.max_model_len",
              f"must be >= {MIN_MODEL_LEN} (a prompt token and a generated one), got {describe(m.max_model_len)}")
        check_choice("model.dtype", m.dtype, WEIGHT_DTYPES)
        check(m.seed >= 0, "model.seed", f"must be an integer in [0, 2^63), got {describe(m.seed)}")
        check(m.checkpoint != "", "model.checkpoint", "must not be empty (leave it out, or name a directory)")
        check(not (m.preset and m.checkpoint), "model.checkpoint",
              "give model.preset or model.checkpoint, not both")
        check(m.checkpoint_if_present is None or m.preset is not None, "model.checkpoint_if_present",
              "needs model.preset, the model served while the directory does not exist")
        check(m.checkpoint_if_present != "", "model.checkpoint_if_present", "must not be empty (leave it out)")
        if m.preset is not None:
            from latentmoe_lab.config import PRESETS

            check_choice("model.preset", m.preset, tuple(sorted(PRESETS)))
        for key in ("tensor_parallel_size", "expert_parallel_size", "pipeline_parallel_size"):
            check_positive_int(f"parallel.{key}", getattr(p, key))
        check(p.forward_threads >= 0, "parallel.forward_threads",
              f"must be an integer >= 0 (0: this process's thread count), got {describe(p.forward_threads)}")
        check(MIN_GROUP_TIMEOUT_S <= p.group_timeout_s <= 3600, "parallel.group_timeout_s",
              f"must be a number of seconds in [{MIN_GROUP_TIMEOUT_S}, 3600], got {describe(p.group_timeout_s)}")
        check_choice("memory.kv_cache_dtype", mem.kv_cache_dtype, CACHE_DTYPES)
        check_choice("memory.index_key_dtype", mem.index_key_dtype, INDEX_KEY_DTYPES)
        check_choice("memory.state_dtype", mem.state_dtype, STATE_DTYPES)
        check(mem.index_key_dtype == "auto" or not (self.disaggregation.enabled or mem.prefix_cache.spills),
              "memory.index_key_dtype", "must be auto with disaggregation: or a memory.prefix_cache spill tier "
              "(host_bytes, disk_dir): their row transfers know the fp8 / int8 / plain layouts only")
        check(0 < mem.gpu_memory_utilization <= 1, "memory.gpu_memory_utilization",
              f"must be a number in (0, 1], got {describe(mem.gpu_memory_utilization)}")
        check(mem.enable_paged_attention, "memory.enable_paged_attention",
              "must be true: the engine serves from paged pools only (the contiguous cache is model.generate's)")
        check_positive_int("memory.max_num_seqs", mem.max_num_seqs)
        check_positive_int("memory.block_size", mem.block_size)
        if mem.cache_bytes is not None:
            check_positive_int("memory.cache_bytes", mem.cache_bytes)
        check_spill_snapshots(mem)
        from latentmoe_lab.parallel.hardware import HARDWARE

        check_choice("memory.device", mem.device, tuple(HARDWARE))
        check_positive_int("scheduler.max_batch_size", s.max_batch_size)
        check_positive_int("scheduler.prefill_chunk_size", s.prefill_chunk_size)
        check(s.max_step_retries >= 0, "scheduler.max_step_retries",
              f"must be an integer >= 0, got {describe(s.max_step_retries)}")
        check(1 <= s.max_log_records <= MAX_LOG_RECORDS, "scheduler.max_log_records",
              f"must be a positive integer, at most {MAX_LOG_RECORDS}, got {describe(s.max_log_records)}")
        e = self.eplb
        for key in ("window_steps", "rebalance_interval_steps", "layers_per_step"):
            check_positive_int(f"eplb.{key}", getattr(e, key))
        check(e.num_redundant_experts >= 0, "eplb.num_redundant_experts",
              f"must be an integer >= 0, got {describe(e.num_redundant_experts)}")
        check(e.num_redundant_experts <= MAX_EPLB_SLOTS, "eplb.num_redundant_experts",
              f"at most {MAX_EPLB_SLOTS} (expert slots per layer), got {describe(e.num_redundant_experts)}")
        check(e.window_steps <= MAX_EPLB_WINDOW_STEPS, "eplb.window_steps",
              f"at most {MAX_EPLB_WINDOW_STEPS} steps (it keeps a counter per step, MoE layer and expert), got "
              f"{describe(e.window_steps)}")
        check(not e.enabled or p.expert_parallel_size > 1, "eplb.enabled",
              "needs parallel.expert_parallel_size > 1 (it balances experts over EP ranks)")
        check_speculative(self.speculative)
        check_disaggregation(self)
        check(s.max_batch_size >= mem.max_num_seqs, "scheduler.max_batch_size",
              f"({s.max_batch_size}) must be >= memory.max_num_seqs ({mem.max_num_seqs}): the engine holds "
              f"every running sequence")

    @property
    def compute_dtype(self) -> str:
        """The dtype the model computes in (and conv tails are stored in): model.dtype, fp8 weights -> bf16."""
        return "bf16" if self.model.dtype == "fp8" else self.model.dtype

    @property
    def cache_dtype(self) -> str:
        """The latent pool's format, 'auto' resolved against the compute dtype."""
        return self.compute_dtype if self.memory.kv_cache_dtype == "auto" else self.memory.kv_cache_dtype


def read_service_file(path: str | Path, name: str) -> dict[str, Any]:
    """The mapping of sections in a service file (yaml_loader's rules; `name` is the argument errors name)."""
    data = read_yaml_file(path, name)
    if not isinstance(data, dict):
        sections = ", ".join(f"{name}:" for name in [*SECTIONS, *OUTER_SECTIONS])
        raise ValueError(f"{file_label(path)}: a service file is a mapping of sections ({sections}), "
                         f"got {describe(data)}")
    return data


def section_values(data: dict[str, Any], name: str) -> dict[str, Any]:
    """The keys of section `name`: {} when absent or left empty (null); an error for any other non-mapping."""
    values = data.get(name)
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"{name}: expected a mapping of keys (or nothing), got {describe(values)}")
    return values


def serving_layout(config, section: ParallelSection):
    """The ParallelConfig of a service's `parallel` section for a ModelConfig `config`; None when the forward runs
    in this process (every size 1 and no parallel.forward_process); ValueError naming the key."""
    from latentmoe_lab.parallel.config import ParallelConfig

    pconfig = ParallelConfig(tp=section.tensor_parallel_size, ep=section.expert_parallel_size,
                             pp=section.pipeline_parallel_size, timeout_s=float(section.group_timeout_s))
    if pconfig.world_size == 1:
        return pconfig if section.forward_process else None
    try:
        pconfig.validate_for(config)  # heads, expert and FFN widths (so the shared experts' too), experts, layers
    except ValueError as error:
        dim, rule = str(error).split(": ", 1)
        raise ValueError(f"parallel.{LAYOUT_KEYS[dim]}: {rule}") from None
    return pconfig
