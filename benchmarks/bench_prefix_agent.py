"""Multi-turn agent prefix hits: hit tokens / ideal and TTFT, prefix caching off, the rule before, hits at any block.

    .venv/bin/python benchmarks/bench_prefix_agent.py            # small preset, 32 conversations x 8 turns
    .venv/bin/python benchmarks/bench_prefix_agent.py --quick    # tiny preset, 8 conversations x 4 turns

The workload (issue 42 item 5): --conversations agents share one system prompt and take --turns turns each.
A conversation is a fixed script of tokens: the system prompt, then one segment per turn (the user's or the
tool's text and the assistant's reply, 17 to 80 tokens), so every turn ends at a random token position and
the system prompt too (its length is not a multiple of the block). Turn k's request is the script up to the
end of segment k, with --max-tokens generated tokens that the script then ignores (a trace replay: every
engine serves the same prompts whatever it samples). All first turns arrive at once; a conversation's next
turn arrives when its previous one finished, so up to --conversations requests wait or run at a time.

Three engines on the same weights serve the workload, taking turns step by step (load spikes of the shared
machine hit all three alike):

    off   prefix caching off
    old   prefix caching, the rule before issue 42: a hit only where a KDA snapshot already is
          (PrefixHits.cut_at_dsa_hit false: no snapshot is left at the DSA hit)
    new   prefix caching, hits at any block boundary (serving/prefix_hits.py): the tail from the nearest
          snapshot to the DSA hit is recomputed and a snapshot left at the DSA hit

Ideal hit tokens of a request: the longest run of its prompt's full blocks (all but the last token) that some
request had computed and registered by the time it was admitted, the best any block-granular cache with
unbounded memory could do (recorded from the engine's own register_block and match_prefix calls). Hit tokens:
RequestMetrics.prefix_hit_tokens, the tokens the request did not compute. Reported per turn (turn 1's split
point is the end of the system prompt, turn k's the end of turn k - 1): hit / ideal, and over the run the
prefill tokens computed and the TTFT, each engine's own: the seconds of its own steps between a request's
arrival and its first token (the other engines' steps in between are not counted). Target: >= 90% of the
ideal hit tokens at every split point. Writes benchmarks/bench_prefix_agent.json (_quick with --quick).
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
from latentmoe_lab.serving.planner import pools_bytes
from latentmoe_lab.serving.sequence import Sequence

from common import apply_threads, machine_info, make_parser, write_json

BLOCK = 16
MODES = ("off", "old", "new")


def scripts(vocab: int, conversations: int, turns: int, system_len: int, seed: int = 1) -> list[list[list[int]]]:
    """Per conversation, the prompt of each turn: the shared system prompt, then segments of 17..80 tokens."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, vocab, (system_len,), generator=g).tolist()
    out = []
    for _ in range(conversations):
        script, prompts = list(system), []
        for _ in range(turns):
            script += torch.randint(0, vocab, (int(torch.randint(17, 81, (1,), generator=g)),), generator=g).tolist()
            prompts.append(list(script))
        out.append(prompts)
    return out


def service(model, mode: str, max_len: int, conversations: int, max_num_seqs: int, chunk: int,
            snapshots: int) -> ServiceConfig:
    """Blocks for every conversation's longest prompt (nothing cached is evicted for room) and, with prefix
    caching, `snapshots` snapshot rows."""
    memory = {"block_size": BLOCK, "max_num_seqs": max_num_seqs}
    if mode != "off":
        memory["prefix_cache"] = {"snapshot_slots": snapshots}
    data = {"model": {"max_model_len": max_len}, "memory": memory,
            "scheduler": {"prefill_chunk_size": chunk, "max_batch_size": conversations}}
    probe = ServiceConfig.from_dict(data)
    blocks = (conversations + max_num_seqs) * -(-max_len // BLOCK)
    data["memory"]["cache_bytes"] = pools_bytes(model.config, probe, blocks, max_num_seqs + snapshots)
    return ServiceConfig.from_dict(data)


class Replay:
    """One engine serving the workload; step() runs one engine step and submits the turns it made due."""

    def __init__(self, engine: Engine, prompts: list[list[list[int]]], max_tokens: int, mode: str):
        self.engine, self.prompts, self.mode = engine, prompts, mode
        self.params = SamplingParams(max_tokens=max_tokens)
        self.clock = 0.0  # seconds of this engine's own steps
        self.pending: dict[int, tuple[int, int, float]] = {}  # request id -> (conversation, turn, arrival)
        self.first_token: dict[int, float] = {}
        self.done: list[dict] = []
        self.registered: set[bytes] = set()  # every block hash registered so far: what an ideal cache holds
        self.ideal: dict[tuple[bytes, ...], int] = {}  # a prompt's block chain -> ideal hit blocks at admission
        if mode != "off":
            self._record_ideal(engine.block_manager)
        for conversation in range(len(prompts)):
            self._submit(conversation, 0)

    def _record_ideal(self, blocks) -> None:
        register, match = blocks.register_block, blocks.match_prefix

        def registering(block_hash, block):
            self.registered.add(block_hash)
            register(block_hash, block)

        def matching(block_hashes):
            chain = 0
            while chain < len(block_hashes) and block_hashes[chain] in self.registered:
                chain += 1
            self.ideal[tuple(block_hashes)] = chain  # the last admission attempt counts
            return match(block_hashes)

        blocks.register_block, blocks.match_prefix = registering, matching

    def _submit(self, conversation: int, turn: int) -> None:
        request_id = self.engine.add_request(self.prompts[conversation][turn], self.params)
        self.pending[request_id] = (conversation, turn, self.clock)

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    def step(self) -> None:
        start = time.perf_counter()
        outputs = self.engine.step()
        self.clock += time.perf_counter() - start
        for out in outputs:
            if out.new_token_ids and out.request_id not in self.first_token:
                self.first_token[out.request_id] = self.clock
            if out.finished:
                conversation, turn, arrival = self.pending.pop(out.request_id)
                prompt = self.prompts[conversation][turn]
                self.done.append({"conversation": conversation, "turn": turn, "tokens": out.token_ids,
                                  "ttft": self.first_token.pop(out.request_id) - arrival,
                                  "hit": out.metrics.prefix_hit_tokens, "ideal": self._ideal_of(prompt)})
                if turn + 1 < len(self.prompts[conversation]):
                    self._submit(conversation, turn + 1)

    def _ideal_of(self, prompt: list[int]) -> int:
        if self.mode == "off":
            return 0
        hashes = Sequence(0, prompt, self.params).block_hashes((len(prompt) - 1) // BLOCK, BLOCK)
        return self.ideal.get(tuple(hashes), 0) * BLOCK


def summary(replay: Replay, turns: int) -> dict:
    done, stats = replay.done, replay.engine.stats()
    per_turn = []
    for turn in range(turns):
        rows = [r for r in done if r["turn"] == turn]
        hit, ideal = sum(r["hit"] for r in rows), sum(r["ideal"] for r in rows)
        per_turn.append({"turn": turn + 1, "hit_tokens": hit, "ideal_tokens": ideal,
                         "hit_over_ideal": round(hit / ideal, 4) if ideal else None})
    ttft = [r["ttft"] for r in done]
    return {"per_turn": per_turn, "hit_tokens": sum(r["hit"] for r in done),
            "ideal_tokens": sum(r["ideal"] for r in done), "ttft_mean_s": statistics.mean(ttft),
            "ttft_median_s": statistics.median(ttft), "engine_seconds": round(replay.clock, 3),
            "prefill_tokens": stats["prefill_tokens"],
            **{k: stats[k] for k in ("prefix_dsa_hit_tokens", "prefix_kda_snapshots_reused",
                                     "prefix_tokens_recomputed")}}


def main() -> None:
    parser = make_parser(__doc__, default_threads=1)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="running sequences (memory.max_num_seqs; default 8, 4 with --quick)")
    parser.add_argument("--snapshots-per-conversation", type=int, default=3,
                        help="snapshot rows (memory.prefix_cache.snapshot_slots) per conversation")
    args = parser.parse_args()
    apply_threads(args)
    preset, conversations, turns, system_len = (("tiny", 8, 4, 75) if args.quick else
                                                ("small", args.conversations, args.turns, 203))
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(ModelConfig.from_preset(preset)).eval()
    prompts = scripts(model.config.vocab_size, conversations, turns, system_len)
    max_len = max(len(p[-1]) for p in prompts) + args.max_tokens
    max_num_seqs = args.max_num_seqs or (4 if args.quick else 8)  # fewer than the conversations: some first turns
    # are admitted after another one left the system prompt's snapshot
    chunk, snapshots = 256, args.snapshots_per_conversation * conversations
    replays = {mode: Replay(Engine(model, service(model, mode, max_len, conversations, max_num_seqs, chunk,
                                                  snapshots)), prompts, args.max_tokens, mode) for mode in MODES}
    replays["old"].engine.scheduler.prefix_hits.cut_at_dsa_hit = False
    load_before, start = os.getloadavg(), time.perf_counter()
    while any(r.busy for r in replays.values()):
        for replay in replays.values():  # one step each in turn
            if replay.busy:
                replay.step()
    wall, load_after = time.perf_counter() - start, os.getloadavg()
    results = {mode: summary(replay, turns) for mode, replay in replays.items()}
    tokens = {mode: {(r["conversation"], r["turn"]): r["tokens"] for r in replay.done}
              for mode, replay in replays.items()}
    for mode in MODES:
        res = results[mode]
        res["ttft_speedup_vs_off"] = round(results["off"]["ttft_mean_s"] / res["ttft_mean_s"], 2)
        res["tokens_agree_with_off"] = sum(tokens[mode][k] == tokens["off"][k] for k in tokens["off"])
        ratios = [t["hit_over_ideal"] for t in res["per_turn"] if t["hit_over_ideal"] is not None]
        res["min_hit_over_ideal"] = min(ratios) if ratios else None
        print(f"{mode:>4}: hit/ideal per turn {[t['hit_over_ideal'] for t in res['per_turn']]}, overall "
              f"{res['hit_tokens']}/{res['ideal_tokens']}; prefill tokens {res['prefill_tokens']}; TTFT mean "
              f"{res['ttft_mean_s'] * 1e3:.1f} ms ({res['ttft_speedup_vs_off']}x vs off); recomputed "
              f"{res['prefix_tokens_recomputed']}, snapshots reused {res['prefix_kda_snapshots_reused']}")
    result = {"machine": machine_info(preset=preset, conversations=conversations, turns=turns,
                                      system_len=system_len, block_size=BLOCK, max_num_seqs=max_num_seqs,
                                      prefill_chunk_size=chunk, snapshot_slots=snapshots,
                                      max_tokens=args.max_tokens, quick=args.quick,
                                      loadavg_before=[round(x, 2) for x in load_before],
                                      loadavg_after=[round(x, 2) for x in load_after]),
              "requests_per_engine": conversations * turns, "wall_seconds": round(wall, 2), "modes": results}
    out = write_json(__file__, result, Path(__file__).with_name(
        "bench_prefix_agent" + ("_quick" if args.quick else "") + ".json"))
    print(f"load average before {load_before}, after {load_after}; wrote {out}")


if __name__ == "__main__":
    main()
