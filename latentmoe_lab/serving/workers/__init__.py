"""The worker processes of a parallel service (docs/design.md §10): one process per rank, the engine in front.

    parallel_runner.py  ParallelRunner: the engine's side, the ModelRunner interface over the ranks
    parallel_worker.py  one rank: its shard of the model, its pools, the commands it answers
    pipeline_stage.py   pipeline parallelism: a stage's layers and the hand-over between stages
"""
