"""`latentmoe-lab convert SRC --out DIR [--to latentmoe|hf]`: a checkpoint from one format to the other
(docs/design.md §17). The command's arguments are registered by cli.py, which passes the model class in
(interop never imports the model).

    --to latentmoe (default)  SRC, a transformers (or our own) directory -> our save_pretrained layout
    --to hf                   SRC, ours (or a transformers directory) -> a transformers directory that
                              AutoModelForCausalLM loads; --model-type picks the architecture (default: the
                              source's own type, else kimi_linear for a model with KDA layers, deepseek_v32 without)

What the target cannot express is refused before DIR is touched (export.export_transformers).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from latentmoe_lab.config import KDA
from latentmoe_lab.interop.detect import architecture, is_transformers_dir, read_config_json
from latentmoe_lab.interop.export import TOKENIZER_FILES, export_transformers

TARGETS = ("latentmoe", "hf")


def convert(model_class: type, source: str | Path, out: str | Path, to: str = "latentmoe",
            model_type: str | None = None, max_shard_size: int | str = "2GB") -> Path:
    """Load `source` with model_class.from_pretrained and write it to `out` in format `to`; returns `out`."""
    if to not in TARGETS:
        raise ValueError(f"to: expected one of {TARGETS}, got {to!r}")
    if model_type is not None:
        if to != "hf":
            raise ValueError("model_type: only with --to hf (it names the transformers architecture to write)")
        architecture(model_type)  # an unknown type fails here, before anything is loaded
    source_type = read_config_json(source).get("model_type") if is_transformers_dir(source) else None
    model = model_class.from_pretrained(source)
    tokenizer_from = Path(source) if (Path(source) / "tokenizer.json").is_file() else None
    if to == "hf":
        if model_type is None:
            model_type = source_type or ("kimi_linear" if KDA in model.config.layer_types else "deepseek_v32")
        return export_transformers(model, out, model_type, max_shard_size=max_shard_size,
                                   tokenizer_from=tokenizer_from)
    out = Path(model.save_pretrained(out, max_shard_size=max_shard_size))
    if source_type is not None and tokenizer_from is not None:  # the checkpoint's own tokenizer, not the byte one
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).is_file():
                shutil.copyfile(tokenizer_from / name, out / name)
    return out
