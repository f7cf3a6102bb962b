"""Quantization recipes: which parts of the model get which weight format, and how activations are treated.

A recipe maps meta.py components to weight formats ("fp8", "int8", "mxfp4"). Inside a quantized component only
the matmul weights of nn.Linear layers and the stacked routed experts are packed. What stays high precision
by rule (docs/design.md §7), whatever the recipe says:
    - embeddings and LM head, every norm, the router (its logits are fp32), the vision tower;
    - KDA gates and state: the forget gate (f_down, f_up, A_log, dt_bias), beta (b_proj), the output gate
      (g_proj), the short conv; and the other sigmoid gates and head weights (DSA w_gate, indexer w_heads).
Activations (not for wkv_b, which absorbed MLA reads as a weight): None (weight only), "dynamic" (1 x 128
groups per token) or "static" (per-tensor, calibrated by `calibration` = "absmax" | "percentile" | "mse"), in
`act_dtype` "int8" or "fp8"; `smooth_alpha` turns on SmoothQuant migration for the packed nn.Linear layers
(not the routed experts, whose inputs are shared).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

QUANTIZABLE_COMPONENTS = ("kda", "mla", "indexer", "latent_projection", "routed_experts", "shared_experts",
                          "dense_ffn")
HIGH_PRECISION_LAYERS = frozenset({"f_down", "f_up", "b_proj", "g_proj", "w_gate", "w_heads"})
# Packed, but weight-only under any recipe: absorbed MLA folds W_kvb into the query and output side and reads
# it as a weight, so no activation ever enters it (docs/design.md §1.4).
WEIGHT_ONLY_LAYERS = frozenset({"wkv_b"})
FORMATS = ("fp8", "int8", "mxfp4")
MXFP4_COMPONENTS = ("routed_experts",)  # 4-bit microscaling is the routed experts' published format
CALIBRATION_METHODS = ("absmax", "percentile", "mse")


@dataclass(frozen=True)
class Recipe:
    name: str
    weights: dict[str, str] = field(default_factory=dict)  # component -> format
    activations: str | None = None
    act_dtype: str = "int8"
    calibration: str = "absmax"
    percentile: float = 99.99
    smooth_alpha: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.weights, dict):
            raise ValueError(f"weights: expected a map of component -> format, got {type(self.weights).__name__}")
        for key, value in (("percentile", self.percentile), ("smooth_alpha", self.smooth_alpha)):
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number and not (key == "smooth_alpha" and value is None):
                raise ValueError(f"{key}: expected a number, got {type(value).__name__} {str(value)[:40]!r}")
        for component, fmt in self.weights.items():
            if component not in QUANTIZABLE_COMPONENTS:
                raise ValueError(f"weights.{component}: not a quantizable component; choose from "
                                 f"{QUANTIZABLE_COMPONENTS}")
            if fmt not in FORMATS:
                raise ValueError(f"weights.{component}: format must be one of {FORMATS}, got {fmt!r}")
            if fmt == "mxfp4" and component not in MXFP4_COMPONENTS:
                raise ValueError(f"weights.{component}: mxfp4 is for {MXFP4_COMPONENTS} only")
        if self.activations not in (None, "dynamic", "static"):
            raise ValueError(f"activations: must be None, 'dynamic' or 'static', got {self.activations!r}")
        if self.act_dtype not in ("int8", "fp8"):
            raise ValueError(f"act_dtype: must be 'int8' or 'fp8', got {self.act_dtype!r}")
        if self.calibration not in CALIBRATION_METHODS:
            raise ValueError(f"calibration: must be one of {CALIBRATION_METHODS}, got {self.calibration!r}")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"percentile: must lie in (0, 100], got {self.percentile!r}")
        if self.smooth_alpha is not None:
            if self.activations is None:
                raise ValueError("smooth_alpha: SmoothQuant needs quantized activations (activations is None)")
            if not 0 <= self.smooth_alpha <= 1:
                raise ValueError(f"smooth_alpha: must lie in [0, 1], got {self.smooth_alpha!r}")

    def weight_format(self, component: str, param_name: str) -> str | None:
        """The format of parameter `param_name` (of meta.COMPONENTS `component`), or None: high precision."""
        if component not in self.weights or HIGH_PRECISION_LAYERS.intersection(param_name.split(".")):
            return None
        return self.weights[component]

    def quantizes_activations(self, param_name: str) -> bool:
        """Whether the packed weight `param_name` also gets an activation quantizer."""
        return self.activations is not None and not WEIGHT_ONLY_LAYERS.intersection(param_name.split("."))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Recipe":
        if not isinstance(data, dict):
            raise TypeError(f"recipe: expected a dict, got {type(data).__name__}")
        return cls(**data)


def _all(fmt: str) -> dict[str, str]:
    return dict.fromkeys(QUANTIZABLE_COMPONENTS, fmt)


RECIPES = {recipe.name: recipe for recipe in (
    Recipe("fp8-experts", {"routed_experts": "fp8"}),
    Recipe("mxfp4-experts", {"routed_experts": "mxfp4"}),
    Recipe("int8-experts", {"routed_experts": "int8"}),
    Recipe("mxfp4-experts-fp8-rest", {**_all("fp8"), "routed_experts": "mxfp4"}),
    Recipe("fp8-all-linear", _all("fp8")),
    Recipe("fp8-w8a8", _all("fp8"), activations="dynamic", act_dtype="fp8"),
    Recipe("int8-w8a8", _all("int8"), activations="dynamic", act_dtype="int8"),
    Recipe("int8-w8a8-static", _all("int8"), activations="static", act_dtype="int8", calibration="mse"),
    Recipe("int8-w8a8-smooth", _all("int8"), activations="static", act_dtype="int8", calibration="mse",
           smooth_alpha=0.5),
)}


def get_recipe(recipe: "str | Recipe | dict") -> Recipe:
    """A Recipe from itself, its name in RECIPES, or its dict form (config.json)."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, dict):
        return Recipe.from_dict(recipe)
    if isinstance(recipe, str) and recipe in RECIPES:
        return RECIPES[recipe]
    raise ValueError(f"recipe: must be a Recipe, a dict or one of {sorted(RECIPES)}, got {recipe!r}")
