"""Issue 44's training levers, each measured against the code before it in one run (loaded-machine figures).

Levers, and the files each changed ("before" is that file set as of --base, by default 103ae49, the commit before
the levers, copied over a copy of this working tree, so every other change in the tree is on both sides):
    kda  the intra-chunk decays and one-block scores as one autograd node (ops/kda_intra.py
         chunk_decays_and_scores; its call sites in ops/kda.py and ops/kda_compiled.py), and halved chunks taking
         the grown form on 8-token blocks (PAIRWISE_SIZE 4, was 8)
    glu  the GLU activations with their slopes formed in the forward (ops/fused_glu.py): FusedGLU in layers/ffn.py
         (dense FFN, shared experts) and layers/moe.py's tile path; glu_backward in ops/routed_experts.py (the
         experts' backward, which recomputed the activation once for dW2 and once for its derivative)

Parts:
  ops   in this process, before / after alternating, forward + backward, medians of --repeats, in CPU seconds of
        this process (time.process_time: the waits of a loaded machine are not counted) and wall seconds:
          kda intra-chunk node vs its twin (ChunkDecays + intra_chunk_scores) at mini's shape (4 chunks, B*H = 24,
            C = 32, K = 64), gates mild (-0.05 sigmoid(x), the layer near init) and K3's lower bound -5 sigmoid(x)
            (most chunks then decay past the growth limit and are halved: the path both sides share), and the
            fused node with halving down to 8-token pairwise blocks (before) or PAIRWISE_SIZE (after)
          FusedGLU vs autograd through ops.routing.expert_glu on the dense FFN's [1024, 576], SwiGLU and SiTU
          the routed experts' backward activation on a mini tile [2048, 2 x 384]: glu_backward vs
            glu_activation_backward + glu_activation (the old recompute)
  inprocess  the mini train step with neither, the kda lever only, and the kda lever and FusedGLU (the others' twins
        patched into the modules' globals): three trainers of one seed alternating step for step in this
        process, CPU and wall medians (the experts' glu_backward stays on in all three)
  step  the mini train step (bench_train_steps.mini_trainer: forward with labels, loss + aux, backward, clip, fused
        AdamW; batch 8 x 128 random ids), one probe process per tree (before, kda only, glu only, after) alternating
        over --rounds; each probe gives its median step (wall and CPU), the fp32 1024^3 matmul rate sampled between
        its steps, and the utilization as bench_train.py computes it (model FLOPs per token x tokens/s / that rate);
        also that ratio in CPU seconds (the step's and the matmul's), which a loaded machine's waits do not move
  run   (--run) the default `latentmoe-lab train --preset mini` in the before and after trees side by side (started
        together, so both meet the same load): the training loop's seconds (trainer_state.json), the command's
        wall and CPU seconds, held-out bits per byte

    python benchmarks/bench_train_levers.py --repeats 15 --rounds 4 --steps 4
    python benchmarks/bench_train_levers.py --quick
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import machine_info, make_parser, write_json

ROOT = Path(__file__).resolve().parent.parent
LEVERS = {"kda": ["latentmoe_lab/ops/kda_intra.py", "latentmoe_lab/ops/kda.py", "latentmoe_lab/ops/kda_compiled.py"],
          "glu": ["latentmoe_lab/layers/ffn.py", "latentmoe_lab/layers/moe.py", "latentmoe_lab/ops/routed_experts.py"]}
TREES = {"before": ("kda", "glu"), "kda_only": ("glu",), "glu_only": ("kda",), "after": ()}  # levers reverted

PROBE = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
steps = int(sys.argv[1])
import latentmoe_lab
from bench_train_parts import matmul_gflops, model_flops_per_token
from bench_train_steps import mini_trainer
from latentmoe_lab.config import ModelConfig
model, step = mini_trainer(ModelConfig.from_preset("mini"), 1e-3, 1, 10 ** 6)
ids = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0))
for _ in range(2):
    step(ids)
a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
wall, cpu, rates, cpu_rates = [], [], [matmul_gflops()], []
for _ in range(steps):
    started, cpu_started = time.perf_counter(), time.process_time()
    loss = step(ids)
    wall.append(time.perf_counter() - started)
    cpu.append(time.process_time() - cpu_started)
    rates.append(matmul_gflops(repeats=1))
    cpu_started = time.process_time()
    a @ b
    cpu_rates.append(2 * 1024 ** 3 / (time.process_time() - cpu_started))
flops = model_flops_per_token(model, 128)["flops_per_token"]
rate, cpu_rate = statistics.median(rates) * 1e9, statistics.median(cpu_rates)
step_s, cpu_s = statistics.median(wall), statistics.median(cpu)
print(json.dumps({"package": latentmoe_lab.__file__, "step_s": step_s, "cpu_s": cpu_s, "matmul_gflops": rate / 1e9,
                  "utilization": flops * 8 * 128 / step_s / rate, "matmul_gflops_cpu": cpu_rate / 1e9,
                  "utilization_cpu": flops * 8 * 128 / cpu_s / cpu_rate, "last_loss": loss}))
"""


def build_tree(into: Path, reverted: tuple[str, ...], base: str) -> Path:
    """A copy of this working tree's package with the reverted levers' files as of commit `base`."""
    shutil.copytree(ROOT / "latentmoe_lab", into / "latentmoe_lab", ignore=shutil.ignore_patterns("__pycache__"))
    for lever in reverted:
        for path in LEVERS[lever]:
            text = subprocess.run(["git", "show", f"{base}:{path}"], cwd=ROOT, check=True, capture_output=True).stdout
            (into / path).write_bytes(text)
    return into


def tree_env(tree: Path, threads: int) -> dict:
    return dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{ROOT / 'benchmarks'}", OMP_NUM_THREADS=str(threads))


def alternate(variants: dict, repeats: int) -> dict:
    """{name: fn}: each fn run once per round, in turn; median CPU and wall ms per name (after one warm-up round)."""
    for fn in variants.values():
        fn()
    cpu, wall = {name: [] for name in variants}, {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - cpu_started)
    return {name: {"cpu_ms": 1e3 * statistics.median(cpu[name]), "wall_ms": 1e3 * statistics.median(wall[name])}
            for name in variants}


def op_levels(repeats: int) -> dict:
    """The ops part (see the module docstring): {case: {"before": ms, "after": ms, "before_over_after": ...}}."""
    from latentmoe_lab.ops.fused_glu import FusedGLU, glu_backward
    from latentmoe_lab.ops.grouped_experts import glu_activation, glu_activation_backward
    from latentmoe_lab.ops import kda_intra
    from latentmoe_lab.ops.kda_intra import ChunkDecays, chunk_decays_and_scores, intra_chunk_scores
    from latentmoe_lab.ops.routing import expert_glu

    gen, pairwise_size = torch.Generator().manual_seed(0), kda_intra.PAIRWISE_SIZE
    results = {}

    def record(case: str, before, after) -> None:
        times = alternate({"before": before, "after": after}, repeats)
        times["before_over_after_cpu"] = times["before"]["cpu_ms"] / times["after"]["cpu_ms"]
        results[case] = times
        print(f"{case}: before {times['before']['cpu_ms']:.2f} ms, after {times['after']['cpu_ms']:.2f} ms CPU "
              f"({times['before_over_after_cpu']:.2f}x)", flush=True)

    shape = (4, 24, 32, 64)
    for gates, scale in (("mild", -0.05), ("k3_lower_bound", -5.0)):
        q, k = (torch.nn.functional.normalize(torch.randn(shape, generator=gen), dim=-1).requires_grad_()
                for _ in range(2))
        beta = torch.rand(shape[:-1], generator=gen).requires_grad_()
        g = (scale * torch.sigmoid(torch.randn(shape, generator=gen))).requires_grad_()
        weights = [torch.randn(shape[:-1] + (shape[-2],), generator=gen) for _ in range(2)]

        def twin(q=q, k=k, beta=beta, g=g, weights=weights):
            decays = ChunkDecays(g)
            scores = intra_chunk_scores(q, k, beta, decays)
            loss = sum((s * w).sum() for s, w in zip(scores, weights)) + decays.from_start.sum() + decays.to_end.sum()
            torch.autograd.grad(loss, (q, k, beta, g))

        def fused(q=q, k=k, beta=beta, g=g, weights=weights):
            decays, *scores = chunk_decays_and_scores(q, k, beta, g)
            loss = sum((s * w).sum() for s, w in zip(scores, weights)) + decays.from_start.sum() + decays.to_end.sum()
            torch.autograd.grad(loss, (q, k, beta, g))

        record(f"kda_intra_{gates}", twin, fused)

        def fused_pairwise(size: int, fused=fused):
            kda_intra.PAIRWISE_SIZE = size
            try:
                fused()
            finally:
                kda_intra.PAIRWISE_SIZE = pairwise_size
        record(f"kda_intra_{gates}_pairwise_8_vs_{pairwise_size}", lambda: fused_pairwise(8),
               lambda: fused_pairwise(pairwise_size))

    rows, inter = 1024, 576
    gate, up = (torch.randn(rows, inter, generator=gen).mul_(3).requires_grad_() for _ in range(2))
    grad_act = torch.randn(rows, inter, generator=gen)
    for name, situ_betas in (("swiglu", None), ("situ", (4.0, 25.0))):
        record(f"glu_{name}_1024x576",
               lambda s=situ_betas: torch.autograd.grad(expert_glu(gate, up, None, s), (gate, up), grad_act),
               lambda s=situ_betas: torch.autograd.grad(FusedGLU.apply(gate, up, None, s), (gate, up), grad_act))

    rows, inter = 2048, 384
    pre, grad_act = torch.randn(rows, 2 * inter, generator=gen).mul_(3), torch.randn(rows, inter, generator=gen)
    grad_pre = torch.empty(rows, 2 * inter)
    for name, situ_betas in (("swiglu", None), ("situ", (4.0, 25.0))):
        # (the old backward consumed its grad_act: it gets a fresh copy, timed with it)
        record(f"experts_backward_activation_{name}_2048x768",
               lambda s=situ_betas: (glu_activation_backward(pre, grad_act.clone(), None, s),
                                     glu_activation(pre, None, s)),
               lambda s=situ_betas: glu_backward(pre[:, :inter].contiguous(), pre[:, inter:], grad_act,
                                                 grad_pre[:, :inter], grad_pre[:, inter:], None, s))
    return results


def inprocess_steps(repeats: int) -> dict:
    """The "inprocess" part (see the module docstring): per variant, median CPU and wall ms of a step, and the
    ratios of each lever."""
    import latentmoe_lab.layers.ffn as ffn_module
    import latentmoe_lab.layers.moe as moe_module
    import latentmoe_lab.ops.kda as kda_module
    from bench_train_steps import mini_trainer

    from latentmoe_lab.config import ModelConfig
    from latentmoe_lab.ops.kda_intra import ChunkDecays, intra_chunk_scores
    from latentmoe_lab.ops.routing import expert_glu

    def twin_intra(q, k, beta, g):
        decays = ChunkDecays(g)
        return (decays, *intra_chunk_scores(q, k, beta, decays))

    sites = [(kda_module, "chunk_decays_and_scores", twin_intra), (ffn_module, "fused_glu", expert_glu),
             (moe_module, "fused_glu", expert_glu)]
    fused = [getattr(module, name) for module, name, _ in sites]
    twins = [twin for _, _, twin in sites]
    variants = {"before": twins, "kda_only": fused[:1] + twins[1:], "after": fused}
    ids = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0))
    steps = {name: mini_trainer(ModelConfig.from_preset("mini"), 1e-3, 1, 10 ** 6)[1] for name in variants}

    def run(name: str) -> None:
        for (module, attribute, _), function in zip(sites, variants[name]):
            setattr(module, attribute, function)
        steps[name](ids)

    try:
        times = alternate({name: lambda name=name: run(name) for name in variants}, repeats)
    finally:
        for (module, attribute, _), function in zip(sites, fused):
            setattr(module, attribute, function)
    for clock in ("cpu", "wall"):
        times[f"kda_lever_{clock}"] = times["before"][f"{clock}_ms"] / times["kda_only"][f"{clock}_ms"]
        times[f"fused_glu_lever_{clock}"] = times["kda_only"][f"{clock}_ms"] / times["after"][f"{clock}_ms"]
        times[f"before_over_after_{clock}"] = times["before"][f"{clock}_ms"] / times["after"][f"{clock}_ms"]
    print(f"in-process mini step CPU ms: before {times['before']['cpu_ms']:.0f}, kda only "
          f"{times['kda_only']['cpu_ms']:.0f}, kda + FusedGLU {times['after']['cpu_ms']:.0f} (kda lever "
          f"{times['kda_lever_cpu']:.3f}x, FusedGLU {times['fused_glu_lever_cpu']:.3f}x, both "
          f"{times['before_over_after_cpu']:.3f}x)", flush=True)
    return times


def probe(tree: Path, steps: int) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(steps)], env=tree_env(tree, 1), cwd=tree,
                          capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"probe in {tree} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["package"].startswith(str(tree)):
        raise RuntimeError(f"probe in {tree} imported {result['package']}")
    return result


def train_steps(trees: dict, rounds: int, steps: int) -> dict:
    """The step part: per tree, the medians over rounds of each probe's medians."""
    runs = {name: [] for name in trees}
    for number in range(rounds):
        for name, tree in trees.items():
            runs[name].append(probe(tree, steps))
            last = runs[name][-1]
            print(f"round {number + 1} {name}: step {last['step_s']:.3f} s wall, {last['cpu_s']:.3f} s CPU, "
                  f"utilization {100 * last['utilization']:.1f}% (CPU-time {100 * last['utilization_cpu']:.1f}%), "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    result = {}
    for name, probes in runs.items():
        result[name] = {key: statistics.median(p[key] for p in probes)
                        for key in ("step_s", "cpu_s", "matmul_gflops", "utilization", "matmul_gflops_cpu",
                                    "utilization_cpu")}
        result[name]["probes"] = probes
        for key in ("step_s", "cpu_s"):
            result[name][f"before_over_this_{key}"] = result["before"][key] / result[name][key]
    return result


def default_runs(trees: dict, steps: int | None) -> dict:
    """`latentmoe-lab train --preset mini` in the before and after trees, started together: the training loop's
    seconds (trainer_state.json), the whole command's wall and CPU seconds (os.wait4), held-out bits per byte."""
    runs = {}
    with tempfile.TemporaryDirectory(prefix="levers_run_") as out_root:
        for name in ("before", "after"):
            command = [sys.executable, "-m", "latentmoe_lab", "train", "--preset", "mini", "--out",
                       str(Path(out_root) / name)] + ([] if steps is None else ["--steps", str(steps)])
            log = open(Path(out_root) / f"{name}.log", "w")  # (a file, not a pipe: tqdm would fill a pipe)
            runs[name] = (time.perf_counter(), log, subprocess.Popen(command, env=tree_env(trees[name], 1),
                                                                     cwd=trees[name], stdout=log, stderr=log))
        result, names = {}, {process.pid: name for name, (_, _, process) in runs.items()}
        while names:  # in the order they finish, so that each wall time is its own
            pid, status, usage = os.wait4(-1, 0)
            name = names.pop(pid)
            started, log, process = runs[name]
            process.returncode = status  # (reaped here, not by Popen)
            wall = time.perf_counter() - started
            log.close()
            if status:
                raise RuntimeError(f"train in the {name} tree failed:\n"
                                   f"{(Path(out_root) / f'{name}.log').read_text()[-3000:]}")
            state = json.loads((Path(out_root) / name / "trainer_state.json").read_text())
            result[name] = {"command_wall_s": wall, "command_cpu_s": usage.ru_utime + usage.ru_stime,
                            "train_seconds": state["seconds"], "steps": state["step"],
                            "held_out_bits_per_byte": {int(e[0]): e[2] for e in state["eval"]}}
    for key in ("train_seconds", "command_cpu_s"):
        result[f"before_over_after_{key}"] = result["before"][key] / result["after"][key]
    return result


def main() -> None:
    parser = make_parser(__doc__, default_threads=1, full_doc=True)
    parser.add_argument("--repeats", type=int, default=15, help="rounds of each op pair (default 15)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating probe rounds per tree (default 4)")
    parser.add_argument("--steps", type=int, default=4, help="timed train steps per probe (default 4)")
    parser.add_argument("--inprocess-steps", type=int, default=12, help="timed steps of each in-process trainer "
                        "(default 12)")
    parser.add_argument("--base", default="103ae49", help="the commit whose lever files are the \"before\" "
                        "(default 103ae49, the last one before the levers)")
    parser.add_argument("--parts", default="ops,inprocess,step", help="which of ops, inprocess, step to run "
                        "(comma-separated; default all three)")
    parser.add_argument("--run", action="store_true", help="also the default train run, before and after together")
    parser.add_argument("--run-steps", type=int, default=None, help="with --run: --steps for both (default: the "
                        "preset's 450)")
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default: bench_train_levers.json here)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.rounds, args.steps, args.run_steps, args.inprocess_steps = 2, 1, 1, 3, 1
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    parts = set(args.parts.split(","))
    result = {}
    if "ops" in parts:
        result["ops"] = op_levels(args.repeats)
    if "inprocess" in parts:
        result["inprocess"] = inprocess_steps(args.inprocess_steps)
    with tempfile.TemporaryDirectory(prefix="levers_trees_") as tree_root:
        trees = {name: build_tree(Path(tree_root) / name, reverted, args.base) for name, reverted in TREES.items()}
        if "step" in parts:
            result["step"] = train_steps(trees, args.rounds, args.steps)
        if args.run:
            result["run"] = default_runs(trees, args.run_steps)
    result["machine"] = machine_info(quick=args.quick, loadavg_before=load_before, loadavg_after=os.getloadavg(),
                                     note="loaded shared 2-core machine: compare ratios within this run only")
    step = result.get("step", {})
    print(" | ".join(f"{name}: {step[name]['step_s']:.3f} s, {100 * step[name]['utilization']:.1f}%, before/this "
                     f"{step[name]['before_over_this_step_s']:.2f}x wall, {step[name]['before_over_this_cpu_s']:.2f}x CPU"
                     for name in step))
    if "run" in result:
        run = result["run"]
        for name in ("before", "after"):
            print(f"default run, {name}: training {run[name]['train_seconds']:.0f} s, command "
                  f"{run[name]['command_wall_s']:.0f} s wall / {run[name]['command_cpu_s']:.0f} s CPU, bits/byte "
                  f"{run[name]['held_out_bits_per_byte']}")
        print(f"before / after: training seconds {run['before_over_after_train_seconds']:.3f}x, command CPU "
              f"{run['before_over_after_command_cpu_s']:.3f}x")
    print(f"results: {write_json(__file__, result, out=args.out)}")


if __name__ == "__main__":
    main()
