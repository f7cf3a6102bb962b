"""`latentmoe-lab profile`: a chrome trace and its HTML summary for one step of a preset.

    latentmoe-lab profile --preset tiny --mode prefill     # also decode | train | engine
    -> reports/profile/tiny-prefill.trace.json  (open in chrome://tracing or ui.perfetto.dev)
       reports/profile/tiny-prefill.html        (top ops, time by component, memory timeline)

engine mode builds a serving Engine around the model, queues --batch requests of --prompt-len tokens,
runs steps until every request is decoding, then traces one decode step of the whole batch.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

MODES = ("prefill", "decode", "train", "engine")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("profile", help="chrome trace + HTML summary of one prefill/decode/train/engine "
                                                   "step",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=("tiny", "small"), help="model preset (default: tiny)")
    parser.add_argument("--mode", default="prefill", choices=MODES, help="the step to trace (default: prefill)")
    parser.add_argument("--batch", type=int, default=1, help="rows or requests (default: 1)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt / sequence tokens (default: 128)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: from the cores available, 1 when 2 or fewer)")
    parser.add_argument("--out", default="reports/profile", help="output folder (default: %(default)s)")
    parser.set_defaults(func=run)
    return parser


def build_step(model, mode: str, batch: int, prompt_len: int):
    """The callable `trace` records for `mode` (see profiling/steps.py)."""
    from latentmoe_lab.profiling import steps

    if mode == "prefill":
        return steps.prefill_step(model, batch, prompt_len)
    if mode == "decode":
        return steps.decode_step(model, batch, prompt_len)
    if mode == "train":
        return steps.train_step(model, batch, prompt_len)
    if mode == "engine":
        return steps.engine_step(decoding_engine(model, batch, prompt_len))
    raise ValueError(f"mode: must be one of {MODES}, got {mode!r}")


def decoding_engine(model, batch: int, prompt_len: int, new_tokens: int = 64):
    """An Engine holding `batch` requests of prompt_len random tokens, stepped until all of them decode."""
    from latentmoe_lab.serving import Engine, SamplingParams, ServiceConfig
    from latentmoe_lab.serving.planner import plan_cache

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    dtype = names[next(model.parameters()).dtype]  # the pools store what the model computes in

    def service(cache_bytes: int) -> ServiceConfig:
        return ServiceConfig.from_dict({
            "model": {"max_model_len": prompt_len + new_tokens + 1, "dtype": dtype},
            "memory": {"cache_bytes": cache_bytes, "block_size": 16, "max_num_seqs": batch},
            "scheduler": {"prefill_chunk_size": max(prompt_len, 64) * batch, "max_batch_size": batch}})

    probe = plan_cache(model.config, service(1 << 50))  # only its per-block and per-slot bytes are used
    blocks = batch * (-(-(prompt_len + new_tokens + 1) // 16))
    engine = Engine(model, service(batch * probe.slot_bytes + blocks * probe.block_bytes),
                    device=next(model.parameters()).device)
    generator = torch.Generator().manual_seed(1)
    for _ in range(batch):
        prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=generator).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=new_tokens))
    for _ in range(batch + 1):  # each step prefills at least one whole prompt
        if not engine.scheduler.waiting and not any(seq.in_prefill for seq in engine.scheduler.running):
            return engine
        engine.step()
    raise RuntimeError(f"engine: {batch} prompts of {prompt_len} tokens were not all prefilled in {batch + 1} steps")


def run(args: argparse.Namespace) -> int:
    from latentmoe_lab import LatentMoEForCausalLM, ModelConfig
    from latentmoe_lab.profiling.summary import trace_summary, write_trace_summary
    from latentmoe_lab.profiling.trace import load_chrome_trace, trace
    from latentmoe_lab.report import check_report_path

    if args.batch < 1 or args.prompt_len < 1:
        raise ValueError(f"--batch and --prompt-len: need >= 1 each, got {args.batch} and {args.prompt_len}")
    check_report_path(Path(args.out) / f"{args.preset}-{args.mode}.html", "--out")
    try:
        device = torch.device(args.device)
    except RuntimeError as error:  # torch's own message lists the device types
        raise ValueError(f"--device: {error}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {args.device!r} needs a CUDA GPU, and torch sees none here")
    from latentmoe_lab.threads import apply_threads

    apply_threads(args.threads)
    torch.manual_seed(args.seed)
    model = LatentMoEForCausalLM(ModelConfig.from_preset(args.preset)).to(args.device)
    if args.mode != "train":
        model.eval()
    step = build_step(model, args.mode, args.batch, args.prompt_len)
    out = Path(args.out)
    name = f"{args.preset}-{args.mode}"
    trace_path = trace(step, out / f"{name}.trace.json")
    title = f"{args.preset}, {args.mode}, batch {args.batch}, {args.prompt_len} tokens"
    html = write_trace_summary(trace_path, out / f"{name}.html", f"Profile: {title}")
    print(terminal_summary(trace_summary(load_chrome_trace(trace_path)), title))
    print(f"trace: {trace_path}\nsummary: {html}")
    return 0


def terminal_summary(summary: dict, title: str, top: int = 5) -> str:
    """Three lines from profiling.summary.trace_summary: the call's time, the heaviest components and ops."""
    wall = summary["wall_s"]

    def ranked(items) -> str:
        best = sorted(items, key=lambda item: item[1], reverse=True)[:top]
        return ", ".join(f"{name} {seconds * 1e3:.2f} ms ({seconds / wall:.0%})" for name, seconds in best) or "none"

    return (f"{title}: the traced call took {wall * 1e3:.2f} ms\n"
            f"time by component (exclusive): {ranked(summary['components'].items())}\n"
            f"heaviest ops (exclusive): {ranked(summary['top_ops'])}")
