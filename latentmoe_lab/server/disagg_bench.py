"""`serve-bench` on a service file with a disaggregation: section (docs/design.md §13.2).

The same synthetic workload as the colocated serve-bench (token prompts only: a payload cannot carry images,
§13.1) goes through a DisaggWorker, as `serve` runs it, driven the way the HTTP handlers call it
(server/drive.py). At the end the router asks each instance process for its engine's step log; the report
shows each instance's steps over time and the transfers between them (server/disagg_report.py). The instances are
stopped before the report is written, whatever happened.
"""
from __future__ import annotations

import argparse
import dataclasses

from latentmoe_lab.serving.metrics import DEFAULT_MAX_RECORDS


def bench_config(path: str, threads: int | None, checkpoint: str | None = None):
    """The service file as `serve` loads it (role plans checked, model.checkpoint_if_present honoured), each
    instance keeping every step record of the run, and --threads as each instance's forward threads."""
    from latentmoe_lab.server.loading import resolve_service

    config, settings = resolve_service(path, checkpoint)
    scheduler = dataclasses.replace(config.scheduler, max_log_records=DEFAULT_MAX_RECORDS)
    parallel = config.parallel if threads is None else dataclasses.replace(config.parallel, forward_threads=threads)
    return dataclasses.replace(config, scheduler=scheduler, parallel=parallel), settings


def serve_bench_disagg(args: argparse.Namespace, say) -> int:
    from tqdm.auto import tqdm

    from latentmoe_lab.report import write_html_report
    from latentmoe_lab.server.disagg_report import disagg_report_sections, instance_line
    from latentmoe_lab.server.disagg_worker import DisaggWorker
    from latentmoe_lab.server.drive import drive
    from latentmoe_lab.server.loading import load_model, source_line
    from latentmoe_lab.serving.bench_workload import synthetic_workload

    if args.image_fraction:
        raise ValueError(f"--image-fraction: a disaggregated service cannot transfer prompts with images "
                         f"(docs/design.md §13.1); give 0, got {args.image_fraction}")
    config, settings = bench_config(args.config, args.threads, args.checkpoint)
    d = config.disaggregation
    say(f"{source_line(config)}; starting {d.prefill_instances} prefill + {d.decode_instances} decode instances")
    worker = DisaggWorker(config, settings, load_model)
    try:
        worker.start()
        requests = synthetic_workload(args.requests, args.rate, args.min_prompt,
                                      min(args.max_prompt, config.model.max_model_len - args.max_tokens),
                                      args.max_tokens, 0.0, worker.model.config.vocab_size, args.seed,
                                      has_vision=False)  # the colocated run's prompts at --image-fraction 0
        with tqdm(total=len(requests), desc="serve-bench") as bar:
            records = drive(worker, requests, progress=bar)
        t0 = min(r.submitted for r in records)
        elapsed = max(r.end for r in records) - t0
        router = worker.router
        step_logs = router.step_logs()
        pids = {instance.name: instance.pid for instance in router.all_instances()}
        transfers = list(worker.transfers)
        counts = {**router.counts, **{f"restarts_{role}": n for role, n in router.restarts.items()}}
    finally:
        worker.stop()
    errors = [r for r in records if r.error]
    generated = sum(len(r.ids) for r in records)
    header = (f"{len(records)} requests ({len(errors)} failed) at {args.rate}/s in {elapsed:.1f} s through "
              f"{d.prefill_instances} prefill + {d.decode_instances} decode instances: {generated / elapsed:.1f} "
              f"generated tokens/s; {counts['transfers']} transfers, {counts['transfer_bytes']:,} bytes, "
              f"{counts['refused']} refused, {counts['recomputed']} recomputed")
    sections = disagg_report_sections(header, records, step_logs, transfers, t0, elapsed, pids, counts)
    print(header)
    print(sections[1])
    for name, steps in step_logs.items():
        print(instance_line(name, pids.get(name), steps, elapsed))
    for record in errors:
        print(f"request {record.key} failed: {record.error}")
    path = write_html_report(args.report, "LatentMoE Lab serve-bench: disaggregated", sections)
    print(f"HTML report: {path}")
    return 0 if not errors else 1
