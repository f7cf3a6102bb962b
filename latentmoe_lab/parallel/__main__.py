"""One layout check per process, for external launchers (GPUs: NCCL; CPUs: gloo).

    torchrun --nproc-per-node 8 -m latentmoe_lab.parallel --ep 4 --tp 2
    accelerate launch --num_processes 8 -m latentmoe_lab.parallel --ep 4 --tp 2

The launcher starts the processes and sets RANK / WORLD_SIZE / MASTER_ADDR; every process runs the
same worker as `latentmoe-lab parallel` (which starts its own processes instead), and rank 0 prints
the comparison with one process and with the planner. Exit status 0 when both hold.
"""
from __future__ import annotations

import argparse
import sys

import torch.distributed as dist

from latentmoe_lab.parallel.runs import (add_layout_arguments, build_reports, check_layouts_worker, layout_from_args,
                                         layout_summary, report_ok)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m latentmoe_lab.parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layout_arguments(parser)
    pconfig, settings = layout_from_args(parser.parse_args(argv))
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
