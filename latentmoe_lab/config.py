"""Model configuration: ModelConfig (the whole model), its validation and JSON/YAML I/O.

The nested parts (KDAConfig, MLAConfig, ...) live in config_parts.py and the presets in config_presets.py;
both are importable from here.

Every field maps onto docs/design.md §1. `ModelConfig.validate()` runs on
construction and raises ValueError naming the field and the rule it broke, so a
bad config fails before any tensor is allocated.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from latentmoe_lab.config_fields import ConfigTypeError, check_field_types, describe, key_name
from latentmoe_lab.config_fields import check as _check
from latentmoe_lab.config_parts import (BIAS_UPDATES, GATE_FORMS, MAX_KDA_CHUNK_SIZE, MOE_ACTIVATIONS, DSAConfig,
                                        IndexerConfig, KDAConfig, MLAConfig, MoEConfig, VisionConfig)
from latentmoe_lab.config_presets import PRESETS
from latentmoe_lab.textfile import read_text_file
from latentmoe_lab.yaml_loader import dump_yaml, errors_name_file, parse_yaml, read_yaml_file

KDA, DSA = "kda", "dsa"  # the two kinds of attention layer (layer_types)


@dataclass
class ModelConfig:
    """The whole model. `layer_types` is derived from `dsa_interval` unless given."""

    name: str = "custom"
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_layers: int = 93
    max_position_embeddings: int = 1_048_576
    first_dense_layers: int = 1
    dense_intermediate_size: int = 33792
    # The dense FFN's activation: "swiglu", or "situ" with moe.situ_beta_gate / _up (K3's layer 0, §18)
    dense_activation: str = "swiglu"
    dsa_interval: int = 4  # Gated DSA at 1-based layers interval, 2*interval, ...
    final_layer_dsa: bool = True  # ... and always at the last layer
    layer_types: list[str] | None = None
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    mtp_depth: int = 0  # multi-token prediction depths (docs/design.md §12, mtp.py); 0 = no MTP head
    attn_res_block_size: int | None = None  # Block AttnRes, layers per block (K3: 12); None = plain residuals (§18)
    kda: KDAConfig = field(default_factory=KDAConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    indexer: IndexerConfig = field(default_factory=IndexerConfig)
    dsa: DSAConfig = field(default_factory=DSAConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    vision: VisionConfig | None = field(default_factory=VisionConfig)

    def __post_init__(self) -> None:
        for name, cls in _NESTED.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, _from_dict(cls, value, prefix=f"{name}."))
            elif not isinstance(value, cls) and not (value is None and name == "vision"):
                raise ConfigTypeError(f"{name}: expected a dict or a {cls.__name__}, got {describe(value)}")
        check_field_types(self)
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_layers, self.dsa_interval, self.final_layer_dsa)
        else:
            self.layer_types = list(self.layer_types)
        self.validate()

    # ----------------------------------------------------------------- queries
    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_dense_layers

    @property
    def num_dsa_layers(self) -> int:
        return self.layer_types.count(DSA)

    @property
    def num_kda_layers(self) -> int:
        return self.layer_types.count(KDA)

    def index_source(self, layer_idx: int) -> int:
        """The layer whose indexer selects for DSA layer `layer_idx`: itself, or with dsa.index_share_every = k
        the first of its group of k consecutive DSA layers (docs/design.md §15.2)."""
        dsa_layers = [i for i, kind in enumerate(self.layer_types) if kind == DSA]
        if layer_idx not in dsa_layers:
            raise ValueError(f"layer_idx: {layer_idx} is not a DSA layer of this config")
        ordinal = dsa_layers.index(layer_idx)
        return dsa_layers[ordinal - ordinal % self.dsa.index_share_every]

    @property
    def num_indexer_layers(self) -> int:
        """DSA layers that run their own lightning indexer (and cache index keys)."""
        if not self.dsa.use_indexer:
            return 0
        return -(-self.num_dsa_layers // self.dsa.index_share_every)

    # -------------------------------------------------------------- validation
    def validate(self) -> None:
        check_field_types(self)
        for name in _NESTED:
            if getattr(self, name) is not None:
                check_field_types(getattr(self, name), prefix=f"{name}.")
        positive = {
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_layers": self.num_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "dense_intermediate_size": self.dense_intermediate_size, "dsa_interval": self.dsa_interval,
            "kda.num_heads": self.kda.num_heads, "kda.head_dim_k": self.kda.head_dim_k,
            "kda.head_dim_v": self.kda.head_dim_v, "kda.conv_kernel": self.kda.conv_kernel,
            "kda.gate_rank": self.kda.gate_rank, "kda.chunk_size": self.kda.chunk_size,
            "mla.num_heads": self.mla.num_heads,
            "mla.kv_lora_rank": self.mla.kv_lora_rank, "mla.qk_nope_head_dim": self.mla.qk_nope_head_dim,
            "mla.v_head_dim": self.mla.v_head_dim, "indexer.num_heads": self.indexer.num_heads,
            "indexer.head_dim": self.indexer.head_dim, "indexer.topk": self.indexer.topk,
            "dsa.index_share_every": self.dsa.index_share_every,
            "moe.num_experts": self.moe.num_experts, "moe.top_k": self.moe.top_k,
            "moe.expert_intermediate_size": self.moe.expert_intermediate_size,
            "moe.latent_size": self.moe.latent_size, "moe.n_group": self.moe.n_group,
            "moe.topk_group": self.moe.topk_group,
        }
        for name, value in positive.items():
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                   name, f"must be a positive integer, got {describe(value)}")
        non_negative = {"first_dense_layers": self.first_dense_layers,
                        "mla.qk_rope_head_dim": self.mla.qk_rope_head_dim, "mtp_depth": self.mtp_depth,
                        "moe.num_shared_experts": self.moe.num_shared_experts}
        for name, value in non_negative.items():
            _check(isinstance(value, int) and value >= 0, name, f"must be an integer >= 0, got {describe(value)}")
        _check(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        _check(self.initializer_range > 0, "initializer_range", "must be > 0 (the std of the initial weights)")
        _check(self.kda.chunk_size <= MAX_KDA_CHUNK_SIZE, "kda.chunk_size",
               f"must be <= {MAX_KDA_CHUNK_SIZE}, got {self.kda.chunk_size} (cost per token grows with the chunk)")

        _check(len(self.layer_types) == self.num_layers, "layer_types",
               f"has {len(self.layer_types)} entries but num_layers is {self.num_layers}")
        bad = sorted(set(self.layer_types) - {KDA, DSA})
        _check(not bad, "layer_types", f"entries must be 'kda' or 'dsa', got {bad}")
        _check(self.first_dense_layers <= self.num_layers, "first_dense_layers",
               f"({self.first_dense_layers}) must not exceed num_layers ({self.num_layers})")

        k = self.kda
        _check(k.gate_form in GATE_FORMS, "kda.gate_form", f"must be one of {GATE_FORMS}, got {describe(k.gate_form)}")
        _check(k.gate_lower_bound < 0, "kda.gate_lower_bound", "must be negative (a log-space decay bound)")
        _check(k.output_gate_rank is None or k.output_gate_rank >= 1, "kda.output_gate_rank",
               "must be None (full rank) or a positive integer")

        m = self.moe
        _check(m.top_k <= m.num_experts, "moe.top_k",
               f"({m.top_k}) must not exceed moe.num_experts ({m.num_experts})")
        _check(m.latent_size <= self.hidden_size, "moe.latent_size",
               f"({m.latent_size}) must not exceed hidden_size ({self.hidden_size})")
        _check(m.num_experts % m.n_group == 0, "moe.n_group",
               f"({m.n_group}) must divide moe.num_experts ({m.num_experts})")
        _check(m.topk_group <= m.n_group, "moe.topk_group",
               f"({m.topk_group}) must not exceed moe.n_group ({m.n_group})")
        if m.n_group > 1:
            per_group = m.num_experts // m.n_group
            _check(per_group >= 2, "moe.n_group", "needs >= 2 experts per group (group score = top-2 sum)")
            _check(m.top_k <= m.topk_group * per_group, "moe.top_k",
                   f"({m.top_k}) exceeds the experts in the kept groups ({m.topk_group} x {per_group})")
        _check(m.routed_scaling_factor > 0, "moe.routed_scaling_factor", "must be > 0")
        _check(m.bias_update_rate >= 0, "moe.bias_update_rate", "must be >= 0")
        _check(m.aux_loss_alpha >= 0, "moe.aux_loss_alpha", "must be >= 0")
        _check(m.z_loss_coef >= 0, "moe.z_loss_coef", "must be >= 0")
        _check(m.activation_clamp is None or m.activation_clamp > 0, "moe.activation_clamp",
               "must be None or > 0")
        _check(m.activation in MOE_ACTIVATIONS, "moe.activation",
               f"must be one of {MOE_ACTIVATIONS}, got {describe(m.activation)}")
        for name in ("situ_beta_gate", "situ_beta_up"):
            value = getattr(m, name)
            _check(math.isfinite(value) and value > 0, f"moe.{name}", f"must be a finite number > 0, got {value!r}")
        _check(m.activation != "situ" or m.activation_clamp is None, "moe.activation_clamp",
               "must be None with moe.activation 'situ' (SiTU bounds both factors itself)")
        _check(self.dense_activation in MOE_ACTIVATIONS, "dense_activation",
               f"must be one of {MOE_ACTIVATIONS}, got {describe(self.dense_activation)}")
        _check(m.bias_update in BIAS_UPDATES, "moe.bias_update",
               f"must be one of {BIAS_UPDATES}, got {describe(m.bias_update)}")
        _check(self.attn_res_block_size is None or self.attn_res_block_size >= 1, "attn_res_block_size",
               f"must be None (plain residuals) or a positive integer (layers per block), "
               f"got {describe(self.attn_res_block_size)}")

        _check(self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim > 0, "mla.qk_nope_head_dim",
               "query/key head dim (nope + rope) must be > 0")
        _check(self.mla.kv_lora_rank <= self.hidden_size, "mla.kv_lora_rank",
               f"({self.mla.kv_lora_rank}) must not exceed hidden_size ({self.hidden_size})")
        q_rank = self.mla.q_lora_rank
        _check(q_rank is None or (q_rank >= 1 and q_rank <= self.hidden_size), "mla.q_lora_rank",
               f"must be None (no q LoRA) or a positive integer <= hidden_size ({self.hidden_size}), got {q_rank}")
        _check(q_rank is not None or not self.dsa.use_indexer or not self.num_dsa_layers, "mla.q_lora_rank",
               "None needs dsa.use_indexer False (the indexer's queries come from the q LoRA latent)")
        _check(self.mla.latent_norm_eps is None or self.mla.latent_norm_eps > 0, "mla.latent_norm_eps",
               f"must be None (rms_norm_eps) or > 0, got {self.mla.latent_norm_eps}")
        _check(m.latent_projection or m.latent_size == self.hidden_size, "moe.latent_size",
               f"({m.latent_size}) must equal hidden_size ({self.hidden_size}) with moe.latent_projection False "
               "(the experts run at the hidden width)")
        _check(self.indexer.topk <= self.max_position_embeddings, "indexer.topk",
               f"({self.indexer.topk}) must not exceed max_position_embeddings ({self.max_position_embeddings})")
        _check_rope(self.mla, self.indexer)

        if self.vision is not None:
            v = self.vision
            for name in ("patch_size", "in_channels", "hidden_size", "num_layers", "num_heads",
                         "intermediate_size", "merge_size"):
                value = getattr(v, name)
                _check(isinstance(value, int) and value >= 1, f"vision.{name}",
                       f"must be a positive integer, got {describe(value)}")
            _check(v.hidden_size % v.num_heads == 0, "vision.num_heads",
                   f"({v.num_heads}) must divide vision.hidden_size ({v.hidden_size})")
            _check((v.hidden_size // v.num_heads) % 4 == 0, "vision.num_heads",
                   f"2D rotary positions need a head dim divisible by 4, got "
                   f"{v.hidden_size} / {v.num_heads} = {v.hidden_size // v.num_heads}")
            ids = {"vision.image_token_id": v.image_token_id, "vision.image_start_id": v.image_start_id,
                   "vision.image_end_id": v.image_end_id}
            for name, value in ids.items():
                _check(isinstance(value, int) and 0 <= value < self.vocab_size, name,
                       f"must be a token id in [0, vocab_size={self.vocab_size}), got {describe(value)}")
            _check(len(set(ids.values())) == 3, "vision.image_token_id",
                   f"image placeholder, start and end ids must differ, got {sorted(ids.values())}")

    # --------------------------------------------------------------------- I/O
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        if not isinstance(data, dict):
            raise TypeError(f"config data must be a dict, got {type(data).__name__}")
        return _from_dict(cls, data, prefix="")

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json_text(cls, text: str) -> "ModelConfig":
        """Parse JSON text (what `to_json()` returns)."""
        return cls.from_dict(_parse(text, "JSON"))

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        """Read a JSON file: a regular file only (no FIFO, directory or device), at most 1 MiB."""
        return cls.from_json_text(read_text_file(path, "path"))

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        """Same as from_json_file: the argument is always a path, never text (use from_json_text)."""
        return cls.from_json_text(read_text_file(path, "path", hint="(from_json takes a file path; "
                                                 "for JSON text use ModelConfig.from_json_text)"))

    def to_yaml(self, path: str | Path | None = None) -> str:
        text = dump_yaml(self.to_dict())
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_yaml_text(cls, text: str) -> "ModelConfig":
        """Parse YAML text (what `to_yaml()` returns)."""
        return cls.from_dict(_parse(text, "YAML"))

    @classmethod
    def from_yaml_file(cls, path: str | Path) -> "ModelConfig":
        """Read a YAML file: a regular file only (no FIFO, directory or device), at most 1 MiB, by
        yaml_loader's rules (no anchors, aliases, tags or duplicate keys); errors name the file."""
        data = read_yaml_file(path, "path")
        with errors_name_file(path):
            return cls.from_dict(data)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ModelConfig":
        """Same as from_yaml_file: the argument is always a path, never text (use from_yaml_text)."""
        data = read_yaml_file(path, "path", hint="(from_yaml takes a file path; for YAML text use "
                                                 "ModelConfig.from_yaml_text)")
        with errors_name_file(path):
            return cls.from_dict(data)

    def replace(self, **changes: Any) -> "ModelConfig":
        """A validated copy with top-level fields changed (nested parts may be given as dicts)."""
        data = self.to_dict()
        if "num_layers" in changes and "layer_types" not in changes:
            data["layer_types"] = None  # re-derive the pattern for the new depth
        data.update(changes)
        return ModelConfig.from_dict(data)

    @classmethod
    def from_preset(cls, name: str) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"preset: unknown name {describe(name)}; choose one of {sorted(PRESETS)}")
        return cls.from_dict(copy.deepcopy(PRESETS[name]))


def default_layer_types(num_layers: int, dsa_interval: int, final_layer_dsa: bool) -> list[str]:
    """Gated DSA at 1-based layers dsa_interval, 2*dsa_interval, ... (and the last); KDA elsewhere."""
    _check(isinstance(dsa_interval, int) and dsa_interval >= 1, "dsa_interval", "must be a positive integer")
    types = [DSA if (i + 1) % dsa_interval == 0 else KDA for i in range(max(num_layers, 0))]
    if final_layer_dsa and types:
        types[-1] = DSA
    return types


_YARN_DEFAULTS = {name: MLAConfig.__dataclass_fields__[name].default for name in MLAConfig.__dataclass_fields__
                  if name.startswith("yarn_")}
ROPE_KINDS = ("none", "rope", "yarn")


def _check_rope(mla: MLAConfig, indexer: IndexerConfig) -> None:
    """mla.rope and its parameters (ops/rotary.py): a parameter away from its default needs the rope that reads it."""
    _check(mla.rope in ROPE_KINDS, "mla.rope", f"must be one of {ROPE_KINDS}, got {describe(mla.rope)}")
    if mla.rope == "none":
        _check(mla.rope_theta == 10000.0, "mla.rope_theta", "is set but mla.rope is 'none' (NoPE)")
    else:
        _check(mla.qk_rope_head_dim >= 2 and mla.qk_rope_head_dim % 2 == 0, "mla.qk_rope_head_dim",
               f"RoPE rotates pairs: must be even and >= 2, got {mla.qk_rope_head_dim}")
        _check(mla.rope_theta > 1, "mla.rope_theta", f"must be > 1, got {mla.rope_theta}")
        _check(indexer.head_dim >= mla.qk_rope_head_dim, "indexer.head_dim",
               f"({indexer.head_dim}) must hold the qk_rope_head_dim ({mla.qk_rope_head_dim}) dims RoPE rotates")
    if mla.rope != "yarn":
        for name, default in _YARN_DEFAULTS.items():
            _check(getattr(mla, name) == default, f"mla.{name}", f"is set but mla.rope is {mla.rope!r}, not 'yarn'")
        return
    _check(mla.yarn_factor >= 1, "mla.yarn_factor", f"must be >= 1, got {mla.yarn_factor}")
    _check(mla.yarn_original_max_position is not None and mla.yarn_original_max_position >= 1,
           "mla.yarn_original_max_position", "YaRN needs the pre-training context length (a positive integer)")
    _check(mla.yarn_beta_fast > 0 and mla.yarn_beta_slow > 0, "mla.yarn_beta_fast", "beta_fast, beta_slow must be > 0")
    for name in ("yarn_mscale", "yarn_mscale_all_dim", "yarn_attention_factor"):
        _check(getattr(mla, name) is None or getattr(mla, name) >= 0, f"mla.{name}", "must be None or >= 0")




def _parse(text: str, language: str) -> Any:
    """JSON or YAML text -> Python data; any parse error becomes a ValueError naming the language."""
    if not isinstance(text, str):
        raise TypeError(f"text: expected {language} text as a str, got {type(text).__name__}")
    if len(text) > 1 << 20:
        raise ValueError(f"text: {len(text)} characters of {language}, more than a config needs (1 MiB)")
    if language == "YAML":
        return parse_yaml(text, "text")  # yaml_loader's rules; its errors name the line and column
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:  # JSONDecodeError is a ValueError
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise ValueError(f"text: not valid JSON: {reason}") from None


_NESTED = {"kda": KDAConfig, "mla": MLAConfig, "indexer": IndexerConfig, "dsa": DSAConfig, "moe": MoEConfig,
           "vision": VisionConfig}


def _from_dict(cls, data: dict[str, Any], prefix: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(key) for key in set(data) - known)
    if unknown:
        raise ValueError(f"{prefix}{key_name(unknown[0])}: unknown config field for {cls.__name__}")
    kwargs = dict(data)
    if cls is ModelConfig:
        for name, nested in _NESTED.items():
            if isinstance(kwargs.get(name), dict):
                kwargs[name] = _from_dict(nested, kwargs[name], prefix=f"{name}.")
    return cls(**kwargs)
