"""Layout checks: run layouts for real and compare them with one process and with the planner.

`check_layouts_worker` runs on every rank of a launch (see launch.py). It builds the same seeded
model and prompt on each rank, computes the single-process reference locally, then for each
layout (all with the launch's world size): builds the mesh, parallelizes the model, runs a
prefill and greedy decoding, and reports logits error, token equality, the bytes its
instrumented collectives moved in the prefill, and who holds which layers and experts.

`run_layouts(layouts, nproc)` launches it and returns one `LayoutReport` per layout, with the
planner's byte prediction (from the reference routing) next to the measured bytes.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.parallel.comm import Comm
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.expert import ParallelMoE, expert_range
from latentmoe_lab.parallel.launch import launch
from latentmoe_lab.parallel.mesh import ProcessMesh, init_distributed
from latentmoe_lab.parallel.parity import TIE_MARGIN, first_differences, parity_line, reference_step_logits
from latentmoe_lab.parallel.pipeline import partition_layers
from latentmoe_lab.parallel.sharded import parallelize
from latentmoe_lab.parallel.traffic import forward_traffic


@dataclass(frozen=True)
class RunSettings:
    """The model and prompt every layout runs (tiny preset, few tokens: a few seconds on 2 cores)."""

    preset: str = "tiny"
    batch: int = 4
    seq_len: int = 40
    new_tokens: int = 3
    seed: int = 0
    timeout_s: float = 20.0
    tie_margin: float = TIE_MARGIN  # parity.py: a greedy token may differ where the reference's margin is below

    def __post_init__(self) -> None:
        # Checked here, before any process is spawned: a bad value must not reach the workers.
        if self.preset not in ("tiny", "small"):
            raise ValueError(f"preset: layout checks run 'tiny' or 'small', got {self.preset!r}")
        for name in ("batch", "seq_len", "new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed: must be an integer >= 0, got {self.seed!r}")
        for name in ("timeout_s", "tie_margin"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s!r}")


@dataclass
class LayoutReport:
    """One layout's outcome. measured / planned: per rank {tag: bytes} for one prefill forward."""

    layout: str
    pconfig: ParallelConfig
    max_abs_logit_error: float
    tokens_equal: bool  # exactly equal
    measured: list[dict[str, int]]
    planned: list[dict[str, int]]
    sent_to: list[dict[int, int]]
    ranks: list[dict] = field(default_factory=list)
    token_differences: list[dict] = field(default_factory=list)  # parity.TokenDifference fields, per row
    tie_margin: float = TIE_MARGIN

    @property
    def bytes_match(self) -> bool:
        return self.measured == self.planned

    @property
    def tokens_match(self) -> bool:
        """Equal, or every row first differs at a near-tie of the reference (parity.py)."""
        return all(d["is_tie"] for d in self.token_differences)


def build_reference(settings: RunSettings) -> tuple[LatentMoEForCausalLM, torch.Tensor]:
    """The seeded single-device model (eval mode) and prompt [batch, seq_len] every rank rebuilds."""
    torch.manual_seed(settings.seed)
    config = ModelConfig.from_preset(settings.preset)
    model = LatentMoEForCausalLM(config).eval()
    prompt = torch.randint(0, config.vocab_size, (settings.batch, settings.seq_len),
                           generator=torch.Generator().manual_seed(settings.seed + 1))
    return model, prompt


@torch.no_grad()
def record_routing(model: LatentMoEForCausalLM, input_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """{MoE layer index: expert indices [B*T, K]} of one forward, tokens in (b t) order."""
    routing, handles = {}, []
    for i, block in enumerate(model.layers):
        if block.is_moe:
            def hook(module, args, i=i):
                routing[i] = module.route(args[0].flatten(0, 1))[1]
            handles.append(block.ffn.register_forward_pre_hook(hook))
    try:
        model(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return routing


def check_layouts_worker(layouts: list[ParallelConfig], settings: RunSettings) -> list[dict]:
    """Per-rank body of `run_layouts`: every layout must use the launch's world size."""
    _, device = init_distributed(settings.timeout_s)
    model, prompt = build_reference(settings)
    with torch.no_grad():
        reference_logits = model(prompt).logits
    reference_tokens = model.generate(prompt, max_new_tokens=settings.new_tokens)
    step_logits = None  # the reference's logits per generated token, computed once a layout differs
    results = []
    for pconfig in layouts:
        mesh = ProcessMesh(pconfig, device)
        comm = Comm(mesh)
        sharded = parallelize(model.to(device), comm)
        local = sharded.local_inputs(prompt.to(device))
        comm.reset()
        local_logits = sharded(local)
        measured = {tag: n for tag, n in comm.bytes.items() if n}
        sent_to = dict(comm.sent_to)
        logits = sharded.gather_logits(local_logits, local.shape[0], local.shape[1])
        tokens = sharded.generate(prompt.to(device), settings.new_tokens)
        moe_layers = [(i, b.ffn) for i, b in zip(sharded.layer_ids, sharded.blocks) if isinstance(b.ffn, ParallelMoE)]
        differences = []
        if tokens.shape != reference_tokens.shape:  # one stopped at eos earlier: no margin to read
            differences = [dict(row=0, step=min(tokens.shape[1], reference_tokens.shape[1]) - prompt.shape[1],
                                reference_token=-1, layout_token=-1, margin=float("inf"), is_tie=False)]
        elif not torch.equal(tokens.cpu(), reference_tokens):
            if step_logits is None:
                step_logits = reference_step_logits(model, reference_tokens.to(device), prompt.shape[1]).cpu()
            differences = [asdict(d) for d in first_differences(reference_tokens, tokens.cpu(), step_logits,
                                                                prompt.shape[1], settings.tie_margin)]
        results.append({
            "layout": pconfig.name(), "rank": mesh.rank, "coords": dict(mesh.coords),
            "max_abs_logit_error": float((logits.cpu() - reference_logits).abs().max()),
            "tokens_equal": bool(torch.equal(tokens.cpu(), reference_tokens)),
            "token_differences": differences,
            "measured": measured, "sent_to": sent_to,
            "layers": list(sharded.layer_ids),
            "experts": list(expert_range(model.config.moe.num_experts, pconfig.ep, mesh.index("ep"))),
            "load": {i: moe.dispatcher.stats.as_dict() for i, moe in moe_layers},
            "stage_seconds": sharded.stage_seconds,
        })
    return results


def run_layouts(layouts: list[ParallelConfig], settings: RunSettings = RunSettings()) -> list[LayoutReport]:
    """Launch every layout (same world size) in one group of processes; compare with one process and the planner."""
    if not layouts:
        raise ValueError("layouts: need at least one ParallelConfig")
    world = {p.world_size for p in layouts}
    if len(world) != 1:
        raise ValueError(f"layouts: all must use the same number of processes, got world sizes {sorted(world)}")
    nproc = world.pop()
    check_run(layouts, settings, nproc)
    per_rank = launch(check_layouts_worker, nproc, (layouts, settings), timeout_s=60.0 + 30.0 * len(layouts))
    return build_reports(layouts, settings, per_rank)


def check_run(layouts: list[ParallelConfig], settings: RunSettings, world_size: int) -> None:
    """Every rule a run must meet, checked in the launching process before any worker starts."""
    config = ModelConfig.from_preset(settings.preset)
    total = settings.seq_len + settings.new_tokens
    if total > config.max_position_embeddings:
        raise ValueError(f"seq_len: prompt + new tokens ({total}) exceed max_position_embeddings "
                         f"({config.max_position_embeddings}) of the {settings.preset} preset")
    for p in layouts:
        p.validate_for(config, world_size)
        p.validate_batch(settings.batch, settings.seq_len)


def build_reports(layouts: list[ParallelConfig], settings: RunSettings,
                  per_rank: list[list[dict]]) -> list[LayoutReport]:
    """Join every rank's results per layout, next to the planner's bytes for the reference routing."""
    model, prompt = build_reference(settings)
    routing = record_routing(model, prompt)
    reports = []
    for k, pconfig in enumerate(layouts):
        ranks = [rank_results[k] for rank_results in per_rank]
        planned = forward_traffic(model.config, pconfig, settings.batch, settings.seq_len, routing=routing,
                                  act_bytes=torch.finfo(torch.float32).bits // 8,
                                  stages=partition_layers(model.config, pconfig.pp, model))
        reports.append(LayoutReport(
            layout=pconfig.name(), pconfig=pconfig,
            max_abs_logit_error=max(r["max_abs_logit_error"] for r in ranks),
            tokens_equal=all(r["tokens_equal"] for r in ranks),
            measured=[r["measured"] for r in ranks], planned=[dict(Counter(p)) for p in planned],
            sent_to=[r["sent_to"] for r in ranks], ranks=ranks,
            token_differences=max((r["token_differences"] for r in ranks), key=len),
            tie_margin=settings.tie_margin))
    return reports


def add_layout_arguments(parser) -> None:
    """The layout and run options shared by `latentmoe-lab parallel` and `python -m latentmoe_lab.parallel`."""
    for dim in ("ep", "tp", "pp", "dp", "cp"):
        parser.add_argument(f"--{dim}", type=int, default=1, help=f"{dim.upper()} size (default: 1)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism inside the TP group")
    parser.add_argument("--no-overlap", action="store_true", help="do not overlap the token all-to-all")
    parser.add_argument("--micro-batches", type=int, default=1, help="pipeline micro-batches (default: 1)")
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"], help="model preset (default: tiny)")
    parser.add_argument("--batch", type=int, default=None, help="prompt rows (default: smallest legal)")
    parser.add_argument("--seq-len", type=int, default=None, help="prompt tokens (default: about 40)")
    parser.add_argument("--new-tokens", type=int, default=3, help="tokens to decode (default: 3)")


def layout_from_args(args) -> tuple[ParallelConfig, RunSettings]:
    pconfig = ParallelConfig(ep=args.ep, tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp, sequence_parallel=args.sp,
                             overlap=not args.no_overlap, micro_batches=args.micro_batches)
    return pconfig, default_settings(pconfig, args.preset, args.batch, args.seq_len, args.new_tokens)


def report_ok(report: LayoutReport) -> bool:
    """Parity with one process (1e-5, same tokens up to near-ties) and bytes exactly as planned."""
    return report.max_abs_logit_error <= 1e-5 and report.tokens_match and report.bytes_match


def default_settings(pconfig: ParallelConfig, preset: str = "tiny", batch: int | None = None,
                     seq_len: int | None = None, new_tokens: int = 3) -> RunSettings:
    """Smallest legal run for a layout: a row per batch shard and micro-batch (at least 2 rows), and
    about 40 tokens, rounded up so cp (and tp under sequence parallelism) divides the sequence."""
    rows = max(2, pconfig.data_shards) * pconfig.micro_batches if batch is None else batch
    multiple = pconfig.cp * (pconfig.tp if pconfig.sequence_parallel else 1)
    length = -(-40 // multiple) * multiple if seq_len is None else seq_len
    return RunSettings(preset=preset, batch=rows, seq_len=length, new_tokens=new_tokens)


def layout_summary(report: LayoutReport) -> str:
    """A few lines: parity with one process, bytes measured vs planned per tag (summed over ranks)."""
    measured, planned = Counter(), Counter()
    for m, p in zip(report.measured, report.planned):
        measured.update(m)
        planned.update(p)
    lines = [f"layout {report.layout} on {report.pconfig.world_size} processes: max |logits - single| = "
             f"{report.max_abs_logit_error:.2e}, bytes per rank equal to the planner: {report.bytes_match}",
             "  " + parity_line(report.token_differences, report.tie_margin),
             f"  {'collective':<16}{'measured':>12}{'planned':>12}   (prefill, all ranks)"]
    for tag in sorted(set(measured) | set(planned)):
        lines.append(f"  {tag:<16}{measured[tag]:>12}{planned[tag]:>12}")
    stages = sorted({tuple(r["layers"]) for r in report.ranks})
    lines.append("  pipeline stages: " + ", ".join(f"layers {s[0]}-{s[-1]}" for s in stages))
    return "\n".join(lines)
