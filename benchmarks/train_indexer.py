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

import time

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.training.indexer import peaked_layer, train_indexer

from common import apply_threads, machine_info, make_parser, write_json

RUNS = {"tiny": dict(steps=300, seq_len=128, log_every=25), "small": dict(steps=150, seq_len=512, log_every=25)}


def main() -> None:
    parser = make_parser(__doc__, default_threads=1)
    args = parser.parse_args()
    apply_threads(args)
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

    out = write_json(__file__, dict(machine=machine_info(), runs=results))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
