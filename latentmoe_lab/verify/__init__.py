"""State correctness as a product: `latentmoe-lab verify` (docs/design.md §19).

    workload.py   the prompts: shared prefixes split inside and on block edges, chunk-long, repetitive
    reference.py  the reference path: model.generate + one full forward per request, no engine
    drive.py      the engine passes (as written, tight cache) and each request's paths; drive_pd.py the P/D pass
    inject.py     planted corruptions (--inject) that a passing verify must be able to catch
    report.py     the per-path table, the first divergence, JSON
    run.py        verify_service: file -> report (the numeric mode and its tolerance)
    cli.py        the `verify` subcommand
"""
