"""Indexer warm-up on the tiny and small configs: KL loss and top-k recall of dense attention mass per step.

    .venv/bin/python benchmarks/train_indexer.py            # tiny: 300 steps, T=128; small: 150 steps, T=512
    .venv/bin/python benchmarks/train_indexer.py --quick    # 20 steps each

One GatedDSA layer per config, its query projection scaled by 6 (latentmoe_lab.training.indexer.peaked_layer:
a stand-in for a trained model's peaky heads), trained with Adam (lr 3e-3) on the indexer's parameters
only, batch 4, fresh synthetic hidden states each step (embeddings of ids from a 32-word vocabulary plus
noise). Loss and recall are logged on one fixed held-out batch. Recall = share of the head-summed dense
attention mass inside the indexer's top-k (tiny: k=32, small: k=256), over queries that see more than k
keys. Writes benchmarks/train_indexer.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.training.indexer import peaked_layer, train_indexer

RUNS = {"tiny": dict(steps=300, seq_len=128, log_every=25), "small": dict(steps=150, seq_len=512, log_every=25)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on the shared 2-core machine two OpenMP threads "
                             "stall on every small op whenever the other core is busy)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    for preset, run in RUNS.items():
        steps = 20 if args.quick else run["steps"]
        config = ModelConfig.from_preset(preset)
        layer = peaked_layer(config)
        start = time.perf_counter()
        history = train_indexer(layer, steps=steps, seq_len=run["seq_len"], log_every=min(run["log_every"], steps))
        seconds = time.perf_counter() - start
        results[preset] = dict(topk=config.indexer.topk, seq_len=run["seq_len"], seconds=seconds,
                               steps=history.steps, loss=history.loss, recall=history.recall)
        print(f"{preset}: index top-{config.indexer.topk} of T={run['seq_len']}, {steps} steps in {seconds:.0f} s")
        print(f"{'step':>6} {'KL loss':>9} {'recall':>8}")
        for step, loss, recall in zip(history.steps, history.loss, history.recall):
            print(f"{step:>6} {loss:>9.4f} {recall:>8.3f}")

    out = Path(__file__).with_suffix(".json")
    out.write_text(json.dumps(dict(machine=dict(platform=platform.platform(), threads=torch.get_num_threads(),
                                                torch=torch.__version__), runs=results), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
