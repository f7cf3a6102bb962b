"""A kimi_linear checkpoint larger than the expert cache (issue 39, docs/design.md §17): load and serve it with the
routed experts left on disk, against the fully loaded model and transformers' own from_pretrained.

    .venv/bin/python benchmarks/bench_load.py                  # >= 6 GB checkpoint, 1 GB expert cache
    .venv/bin/python benchmarks/bench_load.py --size-gb 1.5 --cache-gb 0.25
    .venv/bin/python benchmarks/bench_load.py --quick          # 0.2 GB: checks the harness

The checkpoint (random bf16 weights, kimi_linear-shaped: KDA + NoPE MLA + MoE, a dense first layer) is written
shard by shard by this script, never whole in memory, into --dir (kept with --keep). Each run below is a fresh
process, so its peak RSS (VmHWM) is its own:
    disk      load_with_experts_on_disk(cache --cache-gb), then greedy decoding: load s, peak RSS, tokens/s, the
              expert cache's hit rate
    full      from_pretrained (everything resident), the same decoding: the tokens must be equal
    hf        transformers' AutoModelForCausalLM.from_pretrained on the same directory: load s, peak RSS
The last two run only where the model fits in half the memory available (--skip-full to leave them out).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import apply_threads, machine_info, make_parser, write_json

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.interop import kimi_linear
from latentmoe_lab.interop.names import their_shapes

SHARD_BYTES = 1 << 30


def bench_config(size_gb: float) -> ModelConfig:
    """kimi_linear-shaped, 8 layers (1 dense, 7 MoE; MLA at 1-based 4 and 8), with as many experts per layer as
    make about `size_gb` of bf16 weights."""
    hidden, inter, layers, vocab = 1024, 512, 8, 32000
    expert_bytes = 3 * hidden * inter * 2
    embeddings = 2 * vocab * hidden * 2  # the rest (attention, norms, the dense layer) comes on top: >= size_gb
    experts = max(8, math.ceil((size_gb * 1e9 - embeddings) / (7 * expert_bytes) / 8) * 8)
    hf = {"model_type": "kimi_linear", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 4 * hidden,
          "moe_intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": 8, "kv_lora_rank": 256,
          "q_lora_rank": None, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64,
          "num_local_experts": experts, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
          "n_shared_experts": 1, "routed_scaling_factor": 2.446, "rms_norm_eps": 1e-5, "first_k_dense_replace": 1,
          "max_position_embeddings": 4096,
          "linear_attn_config": {"head_dim": 64, "num_heads": 16, "short_conv_kernel_size": 4,
                                 "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]}}
    return kimi_linear.config_from_hf(hf)


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Weights a trained model could have: matrices ~ N(0, 1/fan_in), norms 1, kimi's A_log / dt_bias ranges."""
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1, 16, generator=generator).log().to(torch.bfloat16)
    if name.endswith("dt_bias"):
        return torch.full(shape, -4.0, dtype=torch.bfloat16)
    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape, dtype=torch.float32)
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=generator) / math.sqrt(shape[-1])).to(torch.bfloat16)


def write_checkpoint(config: ModelConfig, directory: Path) -> int:
    """The checkpoint, one ~1 GB shard in memory at a time; returns its tensor bytes."""
    from latentmoe_lab.model import LatentMoEForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in LatentMoEForCausalLM(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    names = [(name, shape) for entry in kimi_linear.name_table(config)
             for name, shape in zip(entry.theirs, their_shapes(entry, shapes[entry.ours]))]
    shards, current, used, weight_map = [], {}, 0, {}
    for name, shape in names:
        current[name] = random_tensor(name, shape, generator)
        used += current[name].numel() * current[name].element_size()
        if used >= SHARD_BYTES:
            shards.append(_flush(current, directory, len(shards), weight_map))
            current, used = {}, 0
    if current:
        shards.append(_flush(current, directory, len(shards), weight_map))
    for k, file in enumerate(shards):
        final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        (directory / file).rename(directory / final)
        weight_map.update({n: final for n, f in weight_map.items() if f == file})
    total = sum((directory / f).stat().st_size for f in set(weight_map.values()))
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({**kimi_linear.config_to_hf(config), "dtype": "bfloat16"}))
    return total


def _flush(tensors: dict, directory: Path, k: int, weight_map: dict) -> str:
    from safetensors.torch import save_file

    file = f"part-{k}.safetensors"
    save_file(tensors, str(directory / file), metadata={"format": "pt"})
    weight_map.update({name: file for name in tensors})
    return file


def peak_rss() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))


def measure(mode: str, directory: str, cache_gb: float, prompt_len: int, new_tokens: int) -> dict:
    """One run in this (fresh) process: load, then greedy decoding (not for "hf")."""
    from latentmoe_lab.model import LatentMoEForCausalLM

    start = time.perf_counter()
    cache = None
    if mode == "disk":
        from latentmoe_lab.interop.offload import load_with_experts_on_disk

        model, cache = load_with_experts_on_disk(LatentMoEForCausalLM, directory, int(cache_gb * 1e9),
                                                 dtype=torch.bfloat16)
    elif mode == "full":
        model = LatentMoEForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
        return {"load_s": time.perf_counter() - start, "peak_rss_gb": peak_rss() / 1e9}
    load_s = time.perf_counter() - start
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    tokens = model.generate(prompt, max_new_tokens=new_tokens)[0, prompt_len:].tolist()
    seconds = time.perf_counter() - start
    row = {"load_s": load_s, "peak_rss_gb": peak_rss() / 1e9, "tokens_per_s": new_tokens / seconds, "tokens": tokens}
    if cache is not None:
        row.update(cache_hit_rate=cache.hit_rate, cache_experts=cache.capacity)
    return row


def available_bytes() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))


def main() -> None:
    parser = make_parser(__doc__, default_threads=2)
    parser.add_argument("--size-gb", type=float, default=6.0, help="checkpoint size to write (default: 6)")
    parser.add_argument("--cache-gb", type=float, default=1.0, help="expert cache in GB (default: 1)")
    parser.add_argument("--dir", default="/tmp/latentmoe-bench-load", help="where the checkpoint goes")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--skip-full", action="store_true", help="only the experts-on-disk run")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint directory afterwards")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # the child process's run
    args = parser.parse_args()
    apply_threads(args)
    if args.measure:
        print(json.dumps(measure(args.measure, args.dir, args.cache_gb, args.prompt_len, args.new_tokens)))
        return
    if args.quick:
        args.size_gb, args.cache_gb, args.new_tokens = 0.2, 0.02, 4
    directory = Path(args.dir)
    if (directory / "config.json").exists():
        raise SystemExit(f"--dir {directory} already holds a checkpoint; remove it or pass another --dir")
    config = bench_config(args.size_gb)
    start = time.perf_counter()
    size = write_checkpoint(config, directory)
    result = machine_info(checkpoint_gb=size / 1e9, write_s=time.perf_counter() - start,
                          experts_per_layer=config.moe.num_experts, cache_gb=args.cache_gb,
                          memory_available_gb=available_bytes() / 1e9, runs={})
    modes = ["disk"] + ([] if args.skip_full or size > available_bytes() / 2 else ["full", "hf"])
    try:
        for mode in modes:
            out = subprocess.run([sys.executable, __file__, "--measure", mode, "--dir", str(directory),
                                  "--cache-gb", str(args.cache_gb), "--prompt-len", str(args.prompt_len),
                                  "--new-tokens", str(args.new_tokens), "--threads", str(args.threads or 0)],
                                 capture_output=True, text=True, check=True)
            result["runs"][mode] = json.loads(out.stdout.strip().splitlines()[-1])
            print(mode, {k: v for k, v in result["runs"][mode].items() if k != "tokens"}, flush=True)
    finally:
        if not args.keep:
            for file in directory.iterdir():
                file.unlink()
            directory.rmdir()
    if "full" in result["runs"]:
        result["tokens_equal"] = result["runs"]["full"]["tokens"] == result["runs"]["disk"]["tokens"]
        print("greedy tokens equal (disk vs full):", result["tokens_equal"])
    print("wrote", write_json(__file__, result, Path(__file__).with_name("bench_load_quick.json") if args.quick
                                else None))


if __name__ == "__main__":
    main()
