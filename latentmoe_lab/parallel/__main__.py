"""One layout check per process, for external launchers (GPUs: NCCL; CPUs: gloo).

    torchrun --nproc-per-node 8 -m latentmoe_lab.parallel --ep 4 --tp 2
    accelerate launch --num_processes 8 -m latentmoe_lab.parallel --ep 4 --tp 2

The launcher starts the processes and sets RANK / WORLD_SIZE / MASTER_ADDR; every process runs the
same worker as `latentmoe-lab parallel` (which starts its own processes instead), and rank 0 prints
the comparison with one process and with the planner. Exit status 0 when both hold, 1 when they do
not, 2 for bad flags or a missing launcher (one line on stderr; --debug shows the traceback).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist

from latentmoe_lab.parallel.runs import (add_layout_arguments, build_reports, check_layouts_worker, check_run,
                                         layout_from_args, layout_summary, report_ok)

PROG = "python -m latentmoe_lab.parallel"
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _check_launcher(world_size: int) -> None:
    missing = [name for name in LAUNCHER_ENV if name not in os.environ]
    if missing:
        raise ValueError(f"{PROG} runs one rank of a layout check and must be started by a launcher "
                         f"({', '.join(missing)} not set): torchrun --nproc-per-node {world_size} -m "
                         f"latentmoe_lab.parallel ARGS, or accelerate launch --num_processes {world_size} -m "
                         f"latentmoe_lab.parallel ARGS; to start local processes itself, use "
                         f"latentmoe-lab parallel ARGS")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layout_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="on an error, show the full traceback")
    args = parser.parse_args(argv)
    try:
        pconfig, settings = layout_from_args(args)
        _check_launcher(pconfig.world_size)
        check_run([pconfig], settings, int(os.environ["WORLD_SIZE"]))  # before joining the group
    except (ValueError, TypeError) as error:
        if args.debug:
            raise
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    mine = check_layouts_worker([pconfig], settings)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    report = build_reports([pconfig], settings, per_rank)[0]
    if dist.get_rank() == 0:
        print(layout_summary(report), flush=True)
    dist.destroy_process_group()
    return 0 if report_ok(report) else 1


if __name__ == "__main__":
    sys.exit(main())
