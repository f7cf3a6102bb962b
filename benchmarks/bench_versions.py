"""Engine throughput and the mini training step: this tree against an earlier commit, alternating, in one run.

A change that only moves code (the wave-4 consolidation) must leave both where they were; this is the
measurement behind that claim. The earlier commit is unpacked with `git archive` into a temporary directory
(the checkout's git state is not touched), and each round runs one probe process per tree, alternating
(base, head, base, head, ...), so load on a shared machine falls on both alike. Each probe imports the
package from its own tree (PYTHONPATH) and measures, at --threads torch threads:

    train step   mini preset, batch 8 x 128 bytes: forward with labels, CE + aux loss, backward, AdamW;
                 median seconds over --train-steps steps after one warm-up step
    engine       mini preset (random weights, seed 0): 16 prompts of 64-256 tokens, greedy, 32 new tokens each,
                 through Engine.generate; generated tokens per second (median over the rounds)

Both trees run the same probe text, which uses only public names (Engine, ServiceConfig.from_dict,
SamplingParams, LatentMoEForCausalLM, ModelConfig) and service keys both versions read.

    python benchmarks/bench_versions.py --base 58303ce --head 103ae49    # 3 rounds, 1 thread
    python benchmarks/bench_versions.py --base HEAD~1 --quick            # 1 round, small sizes: the harness
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine_info, make_parser, write_json

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import json, statistics, sys, time
import torch
threads, train_steps, requests, new_tokens = (int(v) for v in sys.argv[1:5])
torch.set_num_threads(threads)
from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig

config = ModelConfig.from_preset("mini")
torch.manual_seed(0)
model = LatentMoEForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0))
step_s = []
for number in range(train_steps + 1):
    started = time.perf_counter()
    output = model(ids, labels=ids)
    (output.loss + output.aux_loss).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if number:
        step_s.append(time.perf_counter() - started)

torch.manual_seed(0)
model = LatentMoEForCausalLM(config).eval()
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(0, 256, (int(torch.randint(64, 257, (1,), generator=g)),), generator=g).tolist()
           for _ in range(requests)]
service = ServiceConfig.from_dict({
    "model": {"max_model_len": 512},
    "memory": {"cache_bytes": 256 << 20, "block_size": 64, "max_num_seqs": 16},
    "scheduler": {"prefill_chunk_size": 512, "chunked_prefill": True, "max_batch_size": 256}})
engine = Engine(model, service)
started = time.perf_counter()
outputs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0))
seconds = time.perf_counter() - started
generated = sum(len(o.token_ids) for o in outputs)
print(json.dumps({"train_step_s": statistics.median(step_s), "engine_tokens_per_s": generated / seconds,
                  "engine_tokens": [list(o.token_ids) for o in outputs]}))
"""


def unpack(rev: str, into: Path) -> str:
    """`git archive rev` extracted into `into`; returns the full commit hash."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", commit, "latentmoe_lab"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit


def probe(tree: Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(args.threads))
    done = subprocess.run([sys.executable, "-c", PROBE, str(args.threads), str(args.train_steps),
                           str(args.requests), str(args.new_tokens)], env=env, cwd=tree, capture_output=True,
                          text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"probe in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = make_parser(__doc__, default_threads=1, full_doc=True)
    parser.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    parser.add_argument("--head", default=None, help="the later commit (default: this working tree as it is)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--train-steps", type=int, default=5, help="timed training steps per probe (default 5)")
    parser.add_argument("--requests", type=int, default=16, help="engine requests per probe (default 16)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default: bench_versions.json here)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.train_steps, args.requests, args.new_tokens = 1, 1, 4, 8
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="latentmoe_base_") as base_dir, \
            tempfile.TemporaryDirectory(prefix="latentmoe_head_") as head_dir:
        base_commit = unpack(args.base, Path(base_dir))
        head_commit = "working tree" if args.head is None else unpack(args.head, Path(head_dir))
        trees = {"base": Path(base_dir), "head": ROOT if args.head is None else Path(head_dir)}
        runs = {"base": [], "head": []}
        for number in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(probe(tree, args))
                print(f"round {number + 1} {name}: train step {runs[name][-1]['train_step_s']:.3f} s, engine "
                      f"{runs[name][-1]['engine_tokens_per_s']:.1f} tok/s", flush=True)
    result = {"base": base_commit, "head": head_commit, "rounds": args.rounds}
    for name in ("base", "head"):
        result[name + "_train_step_s"] = statistics.median(r["train_step_s"] for r in runs[name])
        result[name + "_engine_tokens_per_s"] = statistics.median(r["engine_tokens_per_s"] for r in runs[name])
    result["train_step_head_over_base"] = result["head_train_step_s"] / result["base_train_step_s"]
    result["engine_throughput_head_over_base"] = (result["head_engine_tokens_per_s"]
                                                  / result["base_engine_tokens_per_s"])
    result["same_engine_tokens"] = all(b["engine_tokens"] == h["engine_tokens"]
                                       for b, h in zip(runs["base"], runs["head"]))
    result["machine"] = machine_info(quick=args.quick, loadavg_before=load_before, loadavg_after=os.getloadavg())
    print(f"train step head/base {result['train_step_head_over_base']:.3f}, engine throughput head/base "
          f"{result['engine_throughput_head_over_base']:.3f}, same greedy tokens: {result['same_engine_tokens']}")
    print(f"results: {write_json(__file__, result, out=args.out)}")


if __name__ == "__main__":
    main()
