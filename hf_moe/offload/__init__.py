"""Offloaded inference: run an MoE model whose experts do not fit in memory (MoESys's ring of sections).

    model = MoEForCausalLM.from_pretrained(path, offload_experts="disk", max_expert_memory="1GiB")

Only the experts the router picks for the tokens in flight are read, one expert at a time, into a cache bounded by
`max_expert_memory`; while layer l computes, the experts layer l+1's router predicts from layer l's hidden states
are read ahead. The logits are the fully loaded model's. Modules:

    budget.py   parsing max_expert_memory; slots per budget          store.py   per-expert files / host memory
    policy.py   eviction policies (chosen by measurement)              slots.py   which expert is in which slot
    cache.py    the cache: pool, pins, demand reads, prefetch          fetch.py   I/O thread / CUDA side stream
    experts.py  OffloadedExperts, the module in place of Experts       stats.py   hit rate, prefetch accuracy, RSS
    loading.py  from_pretrained(offload_experts=...)                   simulate.py replaying routing traces
"""

from .budget import expert_slots, parse_memory_size
from .cache import ExpertCache
from .experts import OffloadedExperts
from .loading import MODES, describe, expert_cache, load_offloaded
from .policy import DEFAULT_POLICY, POLICIES, CachePolicy
from .stats import CacheStats, GenerationTimer, peak_rss_bytes
from .store import DiskExperts, ExpertLayout, HostExperts

__all__ = [
    "DEFAULT_POLICY", "MODES", "POLICIES", "CachePolicy", "CacheStats", "GenerationTimer", "DiskExperts", "ExpertCache",
    "ExpertLayout",
    "HostExperts", "OffloadedExperts", "describe", "expert_cache", "expert_slots", "load_offloaded",
    "parse_memory_size", "peak_rss_bytes",
]
