"""Routing workloads: router logits built so that top-k routing picks exactly a designed expert set.

Not the workloads of serving (serve-bench's request arrivals), profiling (steps to trace) or the layout
planner (parallel/hardware.Workload: a training or serving shape): these are the six expert-imbalance
patterns the router, the balancer and the MoE benchmarks are studied under.

Each generator designs `expected` [N, K] (the experts every token must reach) and turns it into
logits [N, E]: designed experts sit at +2, the others at -2, plus noise in [-0.5, 0.5), so the
sigmoid scores of the two sets never overlap and `route_topk(logits, K)` (n_group = 1, no bias)
selects exactly `expected`, while the routing weights still differ from token to token.

Spreading a token's slots over a pool of experts is cyclic: slot j of token n goes to
pool[(n * slots + j) % len(pool)]. Slots of one token are consecutive, hence distinct, and every
expert of the pool receives the same number of slots to within one.

    uniform          every expert gets N*K/E                          max/mean = 1
    one_hot_expert   one expert in every token's top-k                max/mean = E/K
    hot_group        half of each top-k inside one group              the group's experts carry most
    dead_expert      one expert gets nothing, the rest share evenly   min/mean = 0
    same_topk        every token to the same K experts                max/mean = E/K, E-K idle
    rotating_hotspot the hot expert moves from phase to phase         balanced overall, hot per phase
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_HIGH, _LOW, _NOISE = 2.0, -2.0, 1.0


@dataclass(frozen=True)
class Workload:
    """name, description; logits [N, E] fp32; expected [N, K] int64 (ascending per token);
    phase [N] int64 (which phase of a rotating hotspot each token belongs to, else 0)."""

    name: str
    description: str
    logits: torch.Tensor
    expected: torch.Tensor
    phase: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.logits.shape[1]

    @property
    def counts(self) -> torch.Tensor:
        """Designed tokens per expert [E] int64."""
        return torch.bincount(self.expected.reshape(-1), minlength=self.num_experts)


def _check_sizes(num_tokens: int, num_experts: int, top_k: int) -> None:
    for name, value in (("num_tokens", num_tokens), ("num_experts", num_experts), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    if top_k >= num_experts:
        raise ValueError(f"top_k: must be below num_experts={num_experts} so that some expert is left out, "
                         f"got {top_k}")


def _check_expert(name: str, value: int, num_experts: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < num_experts:
        raise ValueError(f"{name}: must be an expert id in [0, {num_experts}), got {value!r}")


def _cyclic(pool: torch.Tensor, num_tokens: int, slots: int) -> torch.Tensor:
    """[N, slots] experts from pool, consecutive slots per token, even use of the pool."""
    if slots == 0:
        return pool.new_zeros(num_tokens, 0)
    position = torch.arange(num_tokens)[:, None] * slots + torch.arange(slots)[None, :]
    return pool[position % len(pool)]


def _build(name: str, description: str, expected: torch.Tensor, num_experts: int, generator: torch.Generator,
           phase: torch.Tensor | None = None) -> Workload:
    num_tokens = expected.shape[0]
    logits = torch.full((num_tokens, num_experts), _LOW)
    logits.scatter_(1, expected, _HIGH)
    logits += (torch.rand(num_tokens, num_experts, generator=generator) - 0.5) * _NOISE
    return Workload(name=name, description=description, logits=logits, expected=expected.sort(-1).values,
                    phase=torch.zeros(num_tokens, dtype=torch.int64) if phase is None else phase)


def _shuffled_experts(num_experts: int, generator: torch.Generator, exclude: list[int]) -> torch.Tensor:
    keep = torch.ones(num_experts, dtype=torch.bool)
    keep[exclude] = False
    pool = torch.arange(num_experts)[keep]
    return pool[torch.randperm(len(pool), generator=generator)]


def uniform(num_tokens: int, num_experts: int, top_k: int, seed: int = 0) -> Workload:
    _check_sizes(num_tokens, num_experts, top_k)
    g = torch.Generator().manual_seed(seed)
    expected = _cyclic(_shuffled_experts(num_experts, g, []), num_tokens, top_k)
    return _build("uniform", "every expert gets the same share", expected, num_experts, g)


def one_hot_expert(num_tokens: int, num_experts: int, top_k: int, hot: int = 0, seed: int = 0) -> Workload:
    _check_sizes(num_tokens, num_experts, top_k)
    _check_expert("hot", hot, num_experts)
    g = torch.Generator().manual_seed(seed)
    rest = _cyclic(_shuffled_experts(num_experts, g, [hot]), num_tokens, top_k - 1)
    expected = torch.cat([torch.full((num_tokens, 1), hot), rest], dim=1)
    return _build("one_hot_expert", f"expert {hot} is in every token's top-k", expected, num_experts, g)


def hot_group(num_tokens: int, num_experts: int, top_k: int, n_group: int = 8, group: int = 0,
              seed: int = 0) -> Workload:
    """ceil(K/2) slots of every token land in `group` (of n_group contiguous groups), the rest elsewhere."""
    _check_sizes(num_tokens, num_experts, top_k)
    if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 2 or num_experts % n_group:
        raise ValueError(f"n_group: must be an integer >= 2 dividing num_experts={num_experts}, got {n_group!r}")
    if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < n_group:
        raise ValueError(f"group: must be in [0, n_group={n_group}), got {group!r}")
    per_group = num_experts // n_group
    hot_slots = min((top_k + 1) // 2, per_group)
    if top_k - hot_slots > num_experts - per_group:
        raise ValueError(f"top_k: ({top_k}) leaves more slots than experts outside the hot group")
    g = torch.Generator().manual_seed(seed)
    members = list(range(group * per_group, (group + 1) * per_group))
    inside = _cyclic(torch.tensor(members)[torch.randperm(per_group, generator=g)], num_tokens, hot_slots)
    outside = _cyclic(_shuffled_experts(num_experts, g, members), num_tokens, top_k - hot_slots)
    return _build("hot_group", f"{hot_slots} of {top_k} slots go to group {group} ({per_group} experts)",
                  torch.cat([inside, outside], dim=1), num_experts, g)


def dead_expert(num_tokens: int, num_experts: int, top_k: int, dead: int = 0, seed: int = 0) -> Workload:
    _check_sizes(num_tokens, num_experts, top_k)
    _check_expert("dead", dead, num_experts)
    g = torch.Generator().manual_seed(seed)
    expected = _cyclic(_shuffled_experts(num_experts, g, [dead]), num_tokens, top_k)
    return _build("dead_expert", f"expert {dead} gets nothing", expected, num_experts, g)


def same_topk(num_tokens: int, num_experts: int, top_k: int, seed: int = 0) -> Workload:
    _check_sizes(num_tokens, num_experts, top_k)
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(num_experts, generator=g)[:top_k]
    expected = chosen.expand(num_tokens, top_k).clone()
    return _build("same_topk", "every token goes to the same top-k", expected, num_experts, g)


def rotating_hotspot(num_tokens: int, num_experts: int, top_k: int, num_phases: int = 4, seed: int = 0) -> Workload:
    """Tokens split into num_phases contiguous blocks; block p always reaches hot expert p * E // num_phases."""
    _check_sizes(num_tokens, num_experts, top_k)
    if isinstance(num_phases, bool) or not isinstance(num_phases, int) or not 1 <= num_phases <= num_experts:
        raise ValueError(f"num_phases: must be an integer in [1, num_experts={num_experts}], got {num_phases!r}")
    g = torch.Generator().manual_seed(seed)
    phase = torch.arange(num_tokens) * num_phases // num_tokens
    hot = phase * num_experts // num_phases  # [N]
    # The other K-1 slots cycle through the E-1 experts after the hot one, so they never repeat it.
    offsets = 1 + _cyclic(torch.randperm(num_experts - 1, generator=g), num_tokens, top_k - 1)
    expected = torch.cat([hot[:, None], (hot[:, None] + offsets) % num_experts], dim=1)
    return _build("rotating_hotspot", f"the hot expert moves through {num_phases} phases", expected, num_experts,
                  g, phase=phase)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    fn.__name__: fn for fn in (uniform, one_hot_expert, hot_group, dead_expert, same_topk, rotating_hotspot)
}


def make_workload(name: str, num_tokens: int, num_experts: int, top_k: int, seed: int = 0) -> Workload:
    """One workload by name with its default knobs (hot expert 0, group 0 of 8, 4 phases)."""
    if name not in WORKLOADS:
        raise ValueError(f"name: unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    return WORKLOADS[name](num_tokens, num_experts, top_k, seed=seed)
