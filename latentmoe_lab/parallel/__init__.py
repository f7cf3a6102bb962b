"""Multi-device layouts for LatentMoE, attached to the single-device model from outside.

    config.py     ParallelConfig (ep, tp, pp, dp, cp, sequence_parallel) and its divisibility rules
    mesh.py       rank <-> mesh coordinates; ProcessMesh: one process group per mesh line, with timeouts
    comm.py       instrumented collectives (bytes per tag) and CollectiveError
    expert.py     All-to-All dispatcher (grouped, latent, async) and ParallelMoE (overlap with shared experts)
    tensor.py     head / width slicing of attention, KDA, FFNs and experts; TensorParallel wrapper
    sequence.py   sequence shards for context and sequence parallelism
    context.py    KDA state hand-off and DSA cache gathering across cp ranks
    pipeline.py   stage partition, GPipe / 1F1B schedules, train_step
    sharded.py    parallelize(model, comm) -> ShardedCausalLM (forward, logits, generate)
    launch.py     N local processes through accelerate's notebook_launcher; RankFailure
    runs.py       layout checks against one process and the planner
    traffic.py    the byte model of every collective (exact with routing, expected without)
    hardware.py, planner.py, roofline.py   full-scale memory / traffic / step-time plans
    offload.py    accelerate device maps, disk offload of cold experts, ExpertCache
    eplb/         expert-parallel load balancing (docs/design.md §14): rebalance.py (rebalance_experts),
                  replicas.py (a placement's slot tables and the token -> replica choice), load.py (per-rank
                  load, balancedness, ExpertLoadRecorder), plan.py (on paper), online.py (slot migration and
                  OnlineBalancer on the hand-written EP workers)
"""
from latentmoe_lab.parallel.config import MESH_DIMS, ParallelConfig
from latentmoe_lab.parallel.eplb.load import ExpertLoadRecorder, balance_metrics, rank_loads
from latentmoe_lab.parallel.eplb.rebalance import rebalance_experts
from latentmoe_lab.parallel.hardware import HARDWARE, SERVE_128K, TRAIN_8K, Hardware, Workload
from latentmoe_lab.parallel.launch import RankFailure, launch
from latentmoe_lab.parallel.planner import EXAMPLE_LAYOUTS, LayoutPlan, plan_examples, plan_layout, plan_table
from latentmoe_lab.parallel.runs import LayoutReport, RunSettings, run_layouts

__all__ = ["MESH_DIMS", "ParallelConfig", "HARDWARE", "SERVE_128K", "TRAIN_8K", "Hardware", "Workload",
           "RankFailure", "launch", "EXAMPLE_LAYOUTS", "LayoutPlan", "plan_examples", "plan_layout", "plan_table",
           "LayoutReport", "RunSettings", "run_layouts", "rebalance_experts", "ExpertLoadRecorder", "balance_metrics",
           "rank_loads"]
