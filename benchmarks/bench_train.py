"""Training-step tokens/s for the mini and small presets, forward and backward split by component.

One step = forward with labels (CE + aux losses), backward, AdamW step, as `latentmoe-lab train` runs it
(without the guard). Component times come from module hooks: a forward pre-hook / forward hook pair
times each component's forward, and a full backward pre-hook / backward hook pair its backward.
Components: embedding, KDA attention, Gated DSA attention, LatentMoE FFN, dense FFN, LM head; "other"
is the rest of the step (norms, residual adds, the loss, autograd bookkeeping).

    python benchmarks/bench_train.py                 # mini at 16 x 128 and small at 4 x 256, 3 timed steps
    python benchmarks/bench_train.py --quick         # one timed step each, smaller batches
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
from common import apply_threads, machine_info, make_parser, write_json

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.layers.moe import LatentMoE

CASES = {"mini": (16, 128), "small": (4, 256)}
QUICK_CASES = {"mini": (4, 128), "small": (1, 128)}


def components(model: LatentMoEForCausalLM) -> list[tuple[str, torch.nn.Module]]:
    named = [("embedding", model.embed_tokens), ("lm_head", model.lm_head)]
    for block in model.layers:
        named.append((f"{block.attention_type}_attention", block.attn))
        named.append(("moe_ffn" if isinstance(block.ffn, LatentMoE) else "dense_ffn", block.ffn))
    return named


class ComponentTimer:
    """Seconds per (phase, component), summed over every call since the last reset."""

    def __init__(self, model: LatentMoEForCausalLM):
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self._started: dict[int, float] = {}
        self.handles = []
        for name, module in components(model):
            self.handles += [
                module.register_forward_pre_hook(self._start),
                module.register_forward_hook(lambda m, i, o, name=name: self._stop(m, "forward", name)),
                module.register_full_backward_pre_hook(lambda m, g: self._start(m, None)),
                module.register_full_backward_hook(lambda m, gi, go, name=name: self._stop(m, "backward", name)),
            ]

    def _start(self, module, _inputs):
        self._started[id(module)] = time.perf_counter()

    def _stop(self, module, phase: str, name: str):
        self.seconds[(phase, name)] += time.perf_counter() - self._started.pop(id(module))


def bench(preset: str, batch: int, seq_len: int, steps: int) -> dict:
    config = ModelConfig.from_preset(preset)
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (batch, seq_len))
    timer = ComponentTimer(model)

    def step() -> tuple[float, float, float]:
        start = time.perf_counter()
        out = model(ids, labels=ids)
        mid = time.perf_counter()
        (out.loss + out.aux_loss).backward()
        after_backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return mid - start, after_backward - mid, time.perf_counter() - after_backward

    step()  # warm-up: allocator, first-call paths
    timer.seconds.clear()
    totals = [0.0, 0.0, 0.0]
    for _ in range(steps):
        for i, value in enumerate(step()):
            totals[i] += value
    forward, backward, optim = (t / steps for t in totals)
    split = {f"{phase}/{name}": seconds / steps for (phase, name), seconds in sorted(timer.seconds.items())}
    split["forward/other"] = forward - sum(v for k, v in split.items() if k.startswith("forward/"))
    split["backward/other"] = backward - sum(v for k, v in split.items() if k.startswith("backward/"))
    step_s = forward + backward + optim
    return dict(preset=preset, batch=batch, seq_len=seq_len, parameters=sum(p.numel() for p in model.parameters()),
                step_s=step_s, tokens_per_s=batch * seq_len / step_s, forward_s=forward, backward_s=backward,
                optimizer_s=optim, split_s=split)


def main() -> None:
    parser = make_parser(__doc__, default_threads=None)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per preset (default: 3)")
    parser.add_argument("--presets", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    apply_threads(args)
    cases = QUICK_CASES if args.quick else CASES
    results = []
    for preset in args.presets:
        batch, seq_len = cases[preset]
        result = bench(preset, batch, seq_len, 1 if args.quick else args.steps)
        results.append(result)
        print(f"{preset}: {result['parameters'] / 1e6:.1f}M parameters, batch {batch} x {seq_len}: "
              f"{result['step_s']:.2f} s/step, {result['tokens_per_s']:,.0f} tokens/s "
              f"(forward {result['forward_s']:.2f} s, backward {result['backward_s']:.2f} s, "
              f"AdamW {result['optimizer_s']:.2f} s)")
        for key, seconds in result["split_s"].items():
            print(f"    {key:28s} {seconds * 1000:9.1f} ms  {100 * seconds / result['step_s']:5.1f}%")
    path = write_json(__file__, dict(machine=machine_info(quick=args.quick), results=results))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
