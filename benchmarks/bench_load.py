"""A kimi_linear checkpoint larger than the expert cache (issue 39, docs/design.md §17): load and serve it with the
routed experts left on disk, against the fully loaded model and transformers' own from_pretrained.

    .venv/bin/python benchmarks/bench_load.py                  # >= 6 GB checkpoint, 1 GB expert cache
    .venv/bin/python benchmarks/bench_load.py --size-gb 1.5 --cache-gb 0.25 --out benchmarks/bench_load_1p5gb.json
    .venv/bin/python benchmarks/bench_load.py --quick          # 0.2 GB: checks the harness

The checkpoint (random bf16 weights, kimi_linear-shaped: KDA + NoPE MLA + MoE, a dense first layer) is written
shard by shard by this script, never whole in memory, into --dir (deleted afterwards unless --keep). Each run
below is a fresh process, so its peak RSS (VmHWM) is its own; its imports come before the clock and before
`baseline_rss_gb`, the RSS the load starts from:
    disk      load_with_experts_on_disk(cache --cache-gb), then greedy decoding: load s, peak RSS, tokens/s, the
              expert cache's hit rate, and where the peak goes (rss_account: the baseline, the resident
              weights, the cache's bytes, glibc's free heap, the rest)
    full      from_pretrained (everything resident), the same decoding: the tokens must be equal
    hf        transformers' AutoModelForCausalLM.from_pretrained on the same directory: load s, peak RSS
full runs where the model fits in half the memory available, hf where 2.2x the model does (transformers' load
peaks at about 2x; --skip-full leaves both out). The load average is recorded with every run: the machine is
shared, and its times are those of a loaded machine.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
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


def proc_status(key: str) -> int:
    """A /proc/self/status memory field in bytes: "VmHWM:" (peak RSS), "VmRSS:", "RssFile:" (file pages)."""
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_free_bytes() -> int | None:
    """Bytes free inside glibc's malloc heap (mallinfo2().fordblks): resident, yet held by no tensor; None
    without glibc 2.33+."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    return mallinfo2().fordblks


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers held in memory (meta tensors, left on disk, excluded)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()) if not t.is_meta)


def measure(mode: str, directory: str, cache_gb: float, prompt_len: int, new_tokens: int) -> dict:
    """One run in this (fresh) process: load, then greedy decoding (not for "hf"). Only the run's own imports
    come before the clock."""
    from latentmoe_lab.model import LatentMoEForCausalLM

    if mode == "disk":
        from latentmoe_lab.interop.offload import load_with_experts_on_disk
    elif mode == "hf":
        from transformers import AutoModelForCausalLM
    row = {"loadavg_before": os.getloadavg(), "baseline_rss_gb": proc_status("VmRSS:") / 1e9}
    start = time.perf_counter()
    cache = None
    if mode == "disk":
        model, cache = load_with_experts_on_disk(LatentMoEForCausalLM, directory, int(cache_gb * 1e9),
                                                 dtype=torch.bfloat16)
    elif mode == "full":
        model = LatentMoEForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    row.update(load_s=time.perf_counter() - start, resident_weights_gb=tensor_bytes(model) / 1e9,
               rss_after_load_gb=proc_status("VmRSS:") / 1e9, peak_rss_after_load_gb=proc_status("VmHWM:") / 1e9)
    file_pages = proc_status("RssFile:")
    if mode != "hf":
        prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len),
                               generator=torch.Generator().manual_seed(1))
        start = time.perf_counter()
        row["tokens"] = model.generate(prompt, max_new_tokens=new_tokens)[0, prompt_len:].tolist()
        row["tokens_per_s"] = new_tokens / (time.perf_counter() - start)
    row.update(peak_rss_gb=proc_status("VmHWM:") / 1e9, rss_end_gb=proc_status("VmRSS:") / 1e9,
               file_pages_while_decoding_gb=(proc_status("RssFile:") - file_pages) / 1e9,
               loadavg_after=os.getloadavg())
    if cache is not None:
        cached = sum(t.numel() * t.element_size() for weights in cache.entries.values() for t in weights)
        heap_free = heap_free_bytes()
        row.update(cache_hit_rate=cache.hit_rate, cache_experts=cache.capacity, rss_account=account(
            row, cached / 1e9, None if heap_free is None else heap_free / 1e9))
    return row


def account(row: dict, cache_gb: float, heap_free_gb: float | None) -> dict:
    """Where the disk run's peak RSS goes. At the end of the run: the baseline (torch, the package); what the load
    added beside the weights (the modules torch imports on the model's first meta-device ops); the resident
    weights; the expert cache's bytes; glibc's free heap; file pages mapped while decoding (library code the
    first forward touches, checkpoint pages); anything else. Then the peak's excess over the end."""
    imported = row["rss_after_load_gb"] - row["baseline_rss_gb"] - row["resident_weights_gb"]
    parts = {"baseline_gb": row["baseline_rss_gb"], "load_besides_weights_gb": imported,
             "resident_weights_gb": row["resident_weights_gb"], "expert_cache_gb": cache_gb,
             "heap_free_gb": heap_free_gb, "file_pages_while_decoding_gb": row["file_pages_while_decoding_gb"]}
    return {**parts, "other_gb": row["rss_end_gb"] - sum(v or 0.0 for v in parts.values()),
            "peak_over_end_gb": row["peak_rss_gb"] - row["rss_end_gb"]}


def available_bytes() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))


def summarise(result: dict) -> None:
    """Ratios to the model's bytes and to transformers' load time, and the token check, into result."""
    runs, model_gb = result["runs"], result["checkpoint_gb"]
    for row in runs.values():  # the load's own peak, then the run's (decoding included)
        row["load_peak_over_model"] = row["peak_rss_after_load_gb"] / model_gb
        row["load_peak_above_baseline_over_model"] = (row["peak_rss_after_load_gb"] - row["baseline_rss_gb"]) / model_gb
        row["peak_over_model"] = row["peak_rss_gb"] / model_gb
    if "hf" in runs:
        for mode in ("full", "disk"):
            if mode in runs:
                runs[mode]["load_vs_transformers"] = runs[mode]["load_s"] / runs["hf"]["load_s"]
    if "full" in runs:
        result["tokens_equal"] = runs["full"]["tokens"] == runs["disk"]["tokens"]


def main() -> None:
    parser = make_parser(__doc__, default_threads=1)
    parser.add_argument("--size-gb", type=float, default=6.0, help="checkpoint size to write (default: 6)")
    parser.add_argument("--cache-gb", type=float, default=1.0, help="expert cache in GB (default: 1)")
    parser.add_argument("--dir", default="/tmp/latentmoe-bench-load", help="where the checkpoint goes")
    parser.add_argument("--out", default=None, help="the JSON result (default: next to this script)")
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
                          memory_available_gb=available_bytes() / 1e9, loadavg_start=os.getloadavg(), runs={},
                          skipped={})
    modes = ["disk", "full", "hf"]
    try:
        for mode in modes:
            need = {"disk": 0.0, "full": 2.0, "hf": 2.2}[mode] * size
            if mode != "disk" and (args.skip_full or need > available_bytes()):
                result["skipped"][mode] = ("--skip-full" if args.skip_full else
                                           f"needs ~{need / 1e9:.1f} GB, {available_bytes() / 1e9:.1f} GB available")
                continue
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
    summarise(result)
    result["loadavg_end"] = os.getloadavg()
    if "tokens_equal" in result:
        print("greedy tokens equal (disk vs full):", result["tokens_equal"])
    default_out = Path(__file__).with_name("bench_load_quick.json") if args.quick else None
    print("wrote", write_json(__file__, result, Path(args.out) if args.out else default_out))


if __name__ == "__main__":
    main()
