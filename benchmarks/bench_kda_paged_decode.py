"""Paged KDA decode (issue 13): the fused step in place in the pool against the reference, in one process.

    .venv/bin/python benchmarks/bench_kda_paged_decode.py            # small preset, 32 running sequences
    .venv/bin/python benchmarks/bench_kda_paged_decode.py --quick    # tiny preset, 8 sequences: the harness

Each figure is KimiDeltaAttention.paged_decode "recurrent" (the reference: kda_recurrent on a gathered
copy of the states, scattered back) against "fused" (ops/kda_decode.py's step on views of the pool's own
state rows, one per run of consecutive slots: layers/kda_paged.py), the two alternating call by call so
that load spikes on the shared machine hit both alike; each figure is a median:
  layer            one KDA layer's paged forward for a batch of all-decode sequences in slots 0..S-1
                   (one run), the unit the profile of issue 13 pointed at;
  layer_scattered  the same with the sequences in every other slot (S runs of one: the fused path's worst
                   case, one small step per sequence);
  engine           a whole Engine.step() with every running sequence decoding (as bench_serving.py's
                   overhead bench sets it up), the figure that moves the throughput target.
Writes benchmarks/bench_kda_paged_decode.json. Random weights (seeded), two torch threads by default.
"""
from __future__ import annotations

import statistics
import time

import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.forward_batch import ForwardBatch
from latentmoe_lab.layers.kda import KimiDeltaAttention
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.paged_pools import KDAPool
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig

from common import apply_threads, machine_info, make_parser, write_json

MODES = KimiDeltaAttention.PAGED_DECODES


def alternate(run, steps: int) -> dict[str, float]:
    """Call run(mode) `steps` times per mode, the modes alternating; median milliseconds per mode."""
    times = {mode: [] for mode in MODES}
    for _ in range(steps):
        for mode in MODES:
            start = time.perf_counter()
            run(mode)
            times[mode].append(time.perf_counter() - start)
    return {mode: 1e3 * statistics.median(t) for mode, t in times.items()}


@torch.no_grad()
def bench_layer(config: ModelConfig, seqs: int, steps: int, slot_stride: int = 1) -> dict:
    layer = KimiDeltaAttention(config).eval()
    g = torch.Generator().manual_seed(1)
    slots = seqs * slot_stride
    pool = KDAPool(state=torch.randn(slots, layer.num_heads, layer.head_dim_k, layer.head_dim_v, generator=g),
                   conv=torch.randn(slots, layer.conv_channels, layer.conv_kernel - 1, generator=g))
    batch = ForwardBatch.from_sequences([[0]] * seqs, [100] * seqs, [[i] for i in range(seqs)],
                                        list(range(0, slots, slot_stride)), 128)
    x = torch.randn(1, seqs, config.hidden_size, generator=g)

    def run(mode):
        layer.paged_decode = mode
        layer(x, batch=batch, pool=pool)

    run("fused")  # warm-up
    return alternate(run, steps)


@torch.no_grad()
def bench_engine(model: LatentMoEForCausalLM, seqs: int, steps: int) -> dict:
    service = ServiceConfig.from_dict({
        "model": {"max_model_len": 1024},
        "memory": {"cache_bytes": 256 << 20, "block_size": 64, "max_num_seqs": seqs},
        "scheduler": {"prefill_chunk_size": 1024, "max_batch_size": 256}})
    engine = Engine(model, service)
    g = torch.Generator().manual_seed(2)
    for _ in range(seqs):
        length = int(torch.randint(64, 129, (1,), generator=g))
        engine.add_request(torch.randint(0, 256, (length,), generator=g).tolist(),
                           SamplingParams(max_tokens=4 * steps + 8))
    while any(s.in_prefill or not s.generated_ids for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    layers = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]

    def run(mode):
        for layer in layers:
            layer.paged_decode = mode
        engine.step()

    run("fused")  # warm-up
    result = alternate(run, steps)
    decoding = [s.decode_tokens for s in list(engine.log.steps)[-2 * steps:]]
    for layer in layers:
        layer.paged_decode = "fused"
    return result | {"kda_layers": len(layers), "all_steps_decode_every_sequence": all(n == seqs for n in decoding)}


def main() -> None:
    parser = make_parser(__doc__, default_threads=2)
    parser.add_argument("--steps", type=int, default=16, help="timed calls per mode")
    args = parser.parse_args()
    apply_threads(args)
    preset, seqs = ("tiny", 8) if args.quick else ("small", 32)
    torch.manual_seed(0)
    config = ModelConfig.from_preset(preset)
    model = LatentMoEForCausalLM(config).eval()
    result = {"machine": machine_info(preset=preset, running=seqs, steps=args.steps)}
    for name, bench in (("layer", lambda: bench_layer(config, seqs, args.steps)),
                        ("layer_scattered", lambda: bench_layer(config, seqs, args.steps, slot_stride=2)),
                        ("engine", lambda: bench_engine(model, seqs, args.steps))):
        row = bench()
        row["speedup"] = row["recurrent"] / row["fused"]
        result[name] = row
        print(f"{name:>15}: recurrent {row['recurrent']:.1f} ms, fused {row['fused']:.1f} ms "
              f"-> {row['speedup']:.2f}x", flush=True)
    print(f"wrote {write_json(__file__, result)}")


if __name__ == "__main__":
    main()
