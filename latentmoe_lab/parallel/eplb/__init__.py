"""Expert-parallel load balancing (docs/design.md §14): redundant expert slots and a balanced placement.

    rebalance.py  rebalance_experts(weight [L, E], ...) -> phy2log [L, P], log2phy, logcnt: the balancer
    replicas.py   a placement's check, slot tables and the token -> replica choice (every EP layout uses it)
    load.py       tokens per rank under a placement, balancedness, ExpertLoadRecorder (the balancer's input)
    plan.py       the balancer on paper: a placement's balancedness and the planner's busiest-rank step time
    online.py     while running on the hand-written EP workers: ExpertSlots (staging, switch), ReplicatedDispatcher,
                  OnlineBalancer (the engine's schedule of migrations)
    migration.py  SlotMigrator: a worker stages layers on a side thread and switches them at a step's start
The native DeviceMesh layout holds a placement with native/eplb.py.
"""
from latentmoe_lab.parallel.eplb.rebalance import default_placement, rebalance_experts

__all__ = ["default_placement", "rebalance_experts"]
