"""ServiceConfig: the YAML file that describes one serving deployment (docs/design.md §6.1).

Four sections, the keys of the public example first, then ours where the example is silent:

    model:
      name                  str    label only
      max_model_len         int    prompt + generated tokens of one request, at most
      dtype                 str    weights: fp32 | bf16 | fp16 | fp8 (fp8 = routed experts in block-scaled
                                   FP8, everything else bf16, as meta.py counts it; planning only on a CPU)
      preset                str    ours: a ModelConfig preset ("tiny", "small", "k3-2.8t")
      checkpoint            str    ours: a directory written by save_pretrained (exclusive with preset)
      checkpoint_if_present str    ours: a save_pretrained directory `serve` runs instead of preset when it
                                   exists (server/loading.py; needs preset, the model served without it)
      seed                  int    ours: seed of the random weights when a preset is built (default 0)
    parallel:
      tensor_parallel_size, expert_parallel_size, pipeline_parallel_size   int >= 1
                                   (> 1: the engine's forward runs on that many worker processes;
                                   plan-service plans them at full scale)
      forward_process       bool   ours: with every size 1, run the forward in one worker process anyway
                                   (default false). A server sets it: its engine thread then waits on a
                                   pipe instead of holding the GIL that the HTTP event loop needs
      forward_threads       int    ours: torch threads of that process (default 0: as many as the process
                                   that builds the Engine uses; `latentmoe-lab serve --threads` sets it)
      group_timeout_s       float  ours: seconds in (0, 3600], the timeout of every worker process group
                                   (default 30.0): a rank that hangs is detected within it, so a pipeline
                                   stage's part of a step must finish within it (its successor waits so long)
    memory:
      kv_cache_dtype        str    auto (= model dtype) | fp32 | bf16 | fp16 | fp8: the MLA latent pool
      gpu_memory_utilization float in (0, 1]: share of device memory for weights + caches (plan-service)
      enable_paged_attention bool  must be true: the engine has only the paged path
      max_num_seqs          int    sequences holding cache at once = KDA state slots
      block_size            int    ours: tokens per cache block (default 64)
      cache_bytes           int    ours: the CPU budget for every cache pool, in bytes (required by Engine)
      enable_prefix_caching bool   ours: hash-chained block sharing + KDA state snapshots (default false)
      prefix_snapshot_slots int    ours: KDA snapshot slots for prefix caching (default max_num_seqs when on, else 0)
      device                str    ours: hardware of plan-service, a key of parallel.hardware.HARDWARE
                                   (default H200-141GB)
    scheduler:
      max_batch_size        int    requests held, waiting + running; past it a request is refused ("queue full")
      chunked_prefill       bool   false: a prompt is prefilled whole in one step (it may overrun the budget)
      prefill_chunk_size    int    the token budget of one step (decodes take one token each)
      max_step_retries      int    ours: failed steps a request may be retried after, once a failure is
                                   pinned on it alone (docs/design.md §6.5); one more and it fails alone
                                   with error "engine_step_failed" (default 3; a server sets server.max_retries)
      max_log_records       int    ours: Engine.log keeps the latest this many step and request records
                                   (default 100000; a server keeps fewer)
      batch_invariant       bool   ours: a request's logits bit for bit independent of its step-mates, the
                                   budget and prefix hits (serving/invariance.py; default false: it costs
                                   budget at chunk ends and 13-21% of the engine's throughput on the CPU)

Unknown keys, wrong types and inconsistent values raise ValueError naming the key path.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

WEIGHT_DTYPES = ("fp32", "bf16", "fp16", "fp8")
CACHE_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8", "int8")


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


@dataclass
class MemorySection:
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    enable_paged_attention: bool = True
    max_num_seqs: int = 16
    block_size: int = 64
    cache_bytes: int | None = None
    enable_prefix_caching: bool = False
    prefix_snapshot_slots: int | None = None
    device: str = "H200-141GB"

    @property
    def snapshot_slots(self) -> int:
        """KDA snapshot slots the pools hold besides the max_num_seqs running slots."""
        if not self.enable_prefix_caching:
            return 0
        return self.max_num_seqs if self.prefix_snapshot_slots is None else self.prefix_snapshot_slots


@dataclass
class SchedulerSection:
    max_batch_size: int = 64
    chunked_prefill: bool = True
    prefill_chunk_size: int = 512
    max_step_retries: int = 3
    max_log_records: int = 100_000
    batch_invariant: bool = False


SECTIONS = {"model": ModelSection, "parallel": ParallelSection, "memory": MemorySection,
            "scheduler": SchedulerSection}


@dataclass
class ServiceConfig:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    memory: MemorySection = field(default_factory=MemorySection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ServiceConfig":
        if not isinstance(data, dict):
            raise ValueError(f"service config: expected a mapping of sections, got {type(data).__name__}")
        unknown = sorted(set(data) - set(SECTIONS))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown section; expected some of {list(SECTIONS)}")
        sections = {}
        for name, section_cls in SECTIONS.items():
            values = data.get(name) or {}
            if not isinstance(values, dict):
                raise ValueError(f"{name}: expected a mapping of keys, got {type(values).__name__}")
            sections[name] = _section_from_dict(section_cls, values, name)
        config = cls(**sections)
        config.validate()
        return config

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ServiceConfig":
        import yaml

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"path: no service config file at {str(path)!r}")
        return cls.from_dict(yaml.safe_load(path.read_text()) or {})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(self) -> None:
        m, p, mem, s = self.model, self.parallel, self.memory, self.scheduler
        _positive_int("model.max_model_len", m.max_model_len)
        _choice("model.dtype", m.dtype, WEIGHT_DTYPES)
        _check(isinstance(m.seed, int) and not isinstance(m.seed, bool), "model.seed",
               f"must be an integer, got {m.seed!r}")
        _check(not (m.preset and m.checkpoint), "model.checkpoint",
               "give model.preset or model.checkpoint, not both")
        _check(m.checkpoint_if_present is None or m.preset is not None, "model.checkpoint_if_present",
               "needs model.preset, the model served while the directory does not exist")
        _check(m.checkpoint_if_present != "", "model.checkpoint_if_present", "must not be empty (leave it out)")
        if m.preset is not None:
            from latentmoe_lab.config import PRESETS

            _choice("model.preset", m.preset, tuple(sorted(PRESETS)))
        for key in ("tensor_parallel_size", "expert_parallel_size", "pipeline_parallel_size"):
            _positive_int(f"parallel.{key}", getattr(p, key))
        _check(isinstance(p.forward_process, bool), "parallel.forward_process",
               f"must be true or false, got {p.forward_process!r}")
        _check(isinstance(p.forward_threads, int) and not isinstance(p.forward_threads, bool)
               and p.forward_threads >= 0, "parallel.forward_threads",
               f"must be an integer >= 0 (0: this process's thread count), got {p.forward_threads!r}")
        _check(_is_number(p.group_timeout_s) and 0 < p.group_timeout_s <= 3600, "parallel.group_timeout_s",
               f"must be a number of seconds in (0, 3600], got {p.group_timeout_s!r}")
        _choice("memory.kv_cache_dtype", mem.kv_cache_dtype, CACHE_DTYPES)
        _check(_is_number(mem.gpu_memory_utilization) and 0 < mem.gpu_memory_utilization <= 1,
               "memory.gpu_memory_utilization", f"must be a number in (0, 1], got {mem.gpu_memory_utilization!r}")
        for key in ("enable_paged_attention", "enable_prefix_caching"):
            _check(isinstance(getattr(mem, key), bool), f"memory.{key}", f"must be true or false, got {getattr(mem, key)!r}")
        _check(mem.enable_paged_attention, "memory.enable_paged_attention",
               "must be true: the engine serves from paged pools only (the contiguous cache is model.generate's)")
        _positive_int("memory.max_num_seqs", mem.max_num_seqs)
        _positive_int("memory.block_size", mem.block_size)
        if mem.cache_bytes is not None:
            _positive_int("memory.cache_bytes", mem.cache_bytes)
        if mem.prefix_snapshot_slots is not None:
            _check(isinstance(mem.prefix_snapshot_slots, int) and not isinstance(mem.prefix_snapshot_slots, bool)
                   and mem.prefix_snapshot_slots >= 0, "memory.prefix_snapshot_slots",
                   f"must be an integer >= 0, got {mem.prefix_snapshot_slots!r}")
            _check(mem.enable_prefix_caching or mem.prefix_snapshot_slots == 0, "memory.prefix_snapshot_slots",
                   "snapshots serve prefix caching only: set memory.enable_prefix_caching true or leave this out")
        from latentmoe_lab.parallel.hardware import HARDWARE

        _choice("memory.device", mem.device, tuple(HARDWARE))
        _positive_int("scheduler.max_batch_size", s.max_batch_size)
        _check(isinstance(s.chunked_prefill, bool), "scheduler.chunked_prefill",
               f"must be true or false, got {s.chunked_prefill!r}")
        _positive_int("scheduler.prefill_chunk_size", s.prefill_chunk_size)
        _check(isinstance(s.max_step_retries, int) and not isinstance(s.max_step_retries, bool)
               and s.max_step_retries >= 0, "scheduler.max_step_retries",
               f"must be an integer >= 0, got {s.max_step_retries!r}")
        _positive_int("scheduler.max_log_records", s.max_log_records)
        _check(isinstance(s.batch_invariant, bool), "scheduler.batch_invariant",
               f"must be true or false, got {s.batch_invariant!r}")
        _check(s.max_batch_size >= mem.max_num_seqs, "scheduler.max_batch_size",
               f"({s.max_batch_size}) must be >= memory.max_num_seqs ({mem.max_num_seqs}): the engine holds "
               f"every running sequence")

    @property
    def cache_dtype(self) -> str:
        """The latent pool's format, 'auto' resolved against the model dtype (fp8 weights -> bf16 compute)."""
        if self.memory.kv_cache_dtype != "auto":
            return self.memory.kv_cache_dtype
        return "bf16" if self.model.dtype == "fp8" else self.model.dtype


def _section_from_dict(section_cls, values: dict[str, Any], section: str):
    known = {f.name: f for f in fields(section_cls)}
    for key, value in values.items():
        if key not in known:
            raise ValueError(f"{section}.{key}: unknown key; expected some of {list(known)}")
        _check_type(f"{section}.{key}", value, known[key].type)
    return section_cls(**values)


_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


def _check_type(path: str, value: Any, annotation: str) -> None:
    """Check a YAML value against a field annotation such as 'int | None' (bool is not an int here)."""
    names = [part.strip() for part in str(annotation).split("|")]
    if value is None:
        _check("None" in names, path, "must not be empty (null)")
        return
    allowed = tuple(t for name in names if name != "None" for t in _TYPES[name])
    ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
    _check(ok, path, f"expected {' or '.join(n for n in names if n != 'None')}, got {type(value).__name__} {value!r}")


def _positive_int(path: str, value: Any) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, path,
           f"must be a positive integer, got {value!r}")


def _choice(path: str, value: Any, choices: tuple[str, ...]) -> None:
    _check(value in choices, path, f"must be one of {list(choices)}, got {value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, path: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"{path}: {rule}")
