"""Model configuration: nested dataclasses, presets, validation and JSON/YAML I/O.

Every field maps onto docs/design.md §1. `ModelConfig.validate()` runs on
construction and raises ValueError naming the field and the rule it broke, so a
bad config fails before any tensor is allocated.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from latentmoe_lab.config_fields import ConfigTypeError, check_field_types, describe, key_name
from latentmoe_lab.textfile import read_text_file
from latentmoe_lab.yaml_loader import dump_yaml, errors_name_file, parse_yaml, read_yaml_file

KDA, DSA = "kda", "dsa"
GATE_FORMS = ("lower_bound", "softplus")
# The chunked KDA form pads T up to whole chunks and does O(C^2) work per chunk (C x C decay and score
# matrices, a C-row triangular solve), so the cost per token grows with C; the state hand-off it saves
# costs O(d_k d_v / C) per token. Past a few hundred the quadratic part dominates (4096 made a 40-token
# forward take 8 s), and the Triton kernel tiles at most 128 anyway (ops/kda.py).
MAX_KDA_CHUNK_SIZE = 256


@dataclass
class KDAConfig:
    """Kimi Delta Attention (docs/design.md §1.3)."""

    num_heads: int = 96
    head_dim_k: int = 128
    head_dim_v: int = 128
    conv_kernel: int = 4
    gate_rank: int = 128  # low-rank forget gate: hidden -> gate_rank -> heads * head_dim_k
    gate_form: str = "lower_bound"  # "lower_bound": lb * sigmoid(.) ; "softplus": -exp(A) softplus(.)
    gate_lower_bound: float = -5.0
    output_gate_rank: int | None = None  # None = full-rank output gate
    chunk_size: int = 64


@dataclass
class MLAConfig:
    """Multi-head latent attention inside Gated DSA (docs/design.md §1.4)."""

    num_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # NoPE model: this part is carried but never rotated
    v_head_dim: int = 128


@dataclass
class IndexerConfig:
    """Lightning indexer and top-k selection of DSA (docs/design.md §1.4)."""

    num_heads: int = 64
    head_dim: int = 128
    topk: int = 2048


@dataclass
class DSAConfig:
    """Gated DSA layer options beyond MLA and the indexer (docs/design.md §15.2)."""

    # DSA layers per lightning indexer: 1 = every DSA layer runs its own; k > 1 = of every k consecutive DSA
    # layers only the first has an indexer, the next k - 1 reuse its top-k selection (no indexer weights and
    # no index-key cache of their own).
    index_share_every: int = 1


@dataclass
class MoEConfig:
    """Stable LatentMoE (docs/design.md §1.2)."""

    num_experts: int = 896
    top_k: int = 16
    num_shared_experts: int = 2
    expert_intermediate_size: int = 3072
    latent_size: int = 3584
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    bias_update_rate: float = 1e-3
    aux_loss_alpha: float = 0.0
    z_loss_coef: float = 0.0
    activation_clamp: float | None = None


@dataclass
class VisionConfig:
    """ViT-style vision tower (docs/design.md §1.5). Sizes follow a SigLIP-so400m-class encoder."""

    patch_size: int = 14
    in_channels: int = 3
    hidden_size: int = 1152
    num_layers: int = 27
    num_heads: int = 16
    intermediate_size: int = 4304
    merge_size: int = 2  # 2x2 patch merger
    # Token ids the text side uses for an image span: start, one placeholder per merged patch, end.
    # The defaults are the byte tokenizer's first free ids (latentmoe_lab.tokenizer.SPECIAL_TOKENS).
    image_token_id: int = 256
    image_start_id: int = 257
    image_end_id: int = 258


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
    dsa_interval: int = 4  # Gated DSA at 1-based layers interval, 2*interval, ...
    final_layer_dsa: bool = True  # ... and always at the last layer
    layer_types: list[str] | None = None
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    mtp_depth: int = 0  # multi-token prediction depths (docs/design.md §12, mtp.py); 0 = no MTP head
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
            "mla.num_heads": self.mla.num_heads, "mla.q_lora_rank": self.mla.q_lora_rank,
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

        _check(self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim > 0, "mla.qk_nope_head_dim",
               "query/key head dim (nope + rope) must be > 0")
        _check(self.mla.kv_lora_rank <= self.hidden_size, "mla.kv_lora_rank",
               f"({self.mla.kv_lora_rank}) must not exceed hidden_size ({self.hidden_size})")
        _check(self.mla.q_lora_rank <= self.hidden_size, "mla.q_lora_rank",
               f"({self.mla.q_lora_rank}) must not exceed hidden_size ({self.hidden_size})")
        _check(self.indexer.topk <= self.max_position_embeddings, "indexer.topk",
               f"({self.indexer.topk}) must not exceed max_position_embeddings ({self.max_position_embeddings})")

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


def _check(ok: bool, name: str, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {rule}")


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


PRESETS: dict[str, dict[str, Any]] = {
    # Every mechanism on, small enough that a 256-token forward takes a fraction of a second.
    "tiny": dict(
        name="tiny", vocab_size=512, hidden_size=64, num_layers=4, max_position_embeddings=4096,
        first_dense_layers=1, dense_intermediate_size=128,
        kda=dict(num_heads=2, head_dim_k=16, head_dim_v=16, conv_kernel=4, gate_rank=8, chunk_size=16),
        mla=dict(num_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                 v_head_dim=16),
        indexer=dict(num_heads=2, head_dim=16, topk=32),
        moe=dict(num_experts=8, top_k=2, num_shared_experts=1, expert_intermediate_size=32, latent_size=32,
                 n_group=4, topk_group=2),
        vision=dict(patch_size=14, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64),
    ),
    # ~7M parameters (~2M active per token), every mechanism on: `latentmoe-lab train` on 2 CPU cores.
    # Byte vocabulary (256 bytes + the 4 specials, rounded up); chunk 32 keeps the KDA backward cheap.
    "mini": dict(
        name="mini", vocab_size=384, hidden_size=192, num_layers=4, max_position_embeddings=8192,
        first_dense_layers=1, dense_intermediate_size=576,
        kda=dict(num_heads=3, head_dim_k=64, head_dim_v=64, conv_kernel=4, gate_rank=32, chunk_size=32),
        mla=dict(num_heads=3, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                 v_head_dim=64),
        indexer=dict(num_heads=2, head_dim=32, topk=64),
        moe=dict(num_experts=16, top_k=2, num_shared_experts=1, expert_intermediate_size=384, latent_size=96,
                 n_group=4, topk_group=2),
        vision=dict(patch_size=14, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128),
    ),
    # 50-150M parameters: trainable for a few steps on a CPU.
    "small": dict(
        name="small", vocab_size=32768, hidden_size=512, num_layers=8, max_position_embeddings=65536,
        first_dense_layers=1, dense_intermediate_size=1536,
        kda=dict(num_heads=4, head_dim_k=128, head_dim_v=128, conv_kernel=4, gate_rank=32),
        mla=dict(num_heads=4, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
                 v_head_dim=64),
        indexer=dict(num_heads=4, head_dim=64, topk=256),
        moe=dict(num_experts=32, top_k=4, num_shared_experts=1, expert_intermediate_size=384, latent_size=256,
                 n_group=4, topk_group=2),
        vision=dict(patch_size=14, hidden_size=256, num_layers=4, num_heads=4, intermediate_size=768),
    ),
    # The full-scale table of docs/design.md §1.1.
    "k3-2.8t": dict(name="k3-2.8t"),
}
