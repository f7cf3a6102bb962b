"""The cache tiers below the device pools (docs/design.md §15): where prefix-cache blocks and DSA rows go
when the device is full.

      cache_section.py      the memory.prefix_cache: and memory.offload: sections (and the keys they replace)
    prefix-cache spill (§15.2)  evicted prefix blocks + KDA snapshots -> host memory -> disk, restored on a hit
      spill.py              PrefixSpill: the tiers behind the block manager's prefix cache
      spill_host.py         the host tier (an LRU of blocks' bytes)
      spill_disk.py         the disk tier (one file per block, checksummed)
      spill_blocks.py       a block's rows and a snapshot row, read and written through the engine's runner
    DSA rows in a host tier (§15.1)
      offload_tier.py       OffloadedPools: latent rows on the host, per-sequence hot buffers on the device;
                            offload_counters, its counters in Engine.stats()
      offload_plan.py       one request's bytes per tier, plan-service's long-context text (the plan itself:
                            serving/planner.py plan_offloaded)
"""
