"""The expert cache: S slots on the compute device shared by every MoE layer, filled on demand and ahead.

    pool[name]  [S, *shape]   one expert per slot (S = max_expert_memory // bytes of one expert)

A layer computes with the pool as if it were a fused `Experts` of S experts (`pool_experts`): the tokens' expert ids
are translated into slot ids, so `hf_moe.ops.experts_forward` runs unchanged and nothing is copied into a compact
buffer first. Ids of experts not resident in this pass translate to -1 (a dropped pair: zero contribution).

One MoE layer's forward (see `OffloadedExperts.forward`):

    chunks = begin(l, experts)     the experts its tokens picked; counts uses and hits; more than S -> several passes
    for chunk in chunks:
        ahead = predict(l + 1, hidden)      layer l+1's router applied to layer l's hidden states (first pass only)
        remap = acquire(l, chunk, ahead)    pin the resident ones, place the misses (evicting by policy), start
                                            fetching `ahead`, read the misses, wait for any still arriving
        ... compute ...
        release()

Bookkeeping runs on the forward's thread only; the I/O thread (or CUDA side stream) only fills slots it is given.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
from transformers.activations import ACT2FN

from ..layers.quantized import QuantizedExperts
from ..memory import SKIP_VARIABLE, free_memory, size_check_skipped
from ..ops import experts_forward
from .budget import expert_slots, format_size
from .fetch import CudaStreamFetcher, ThreadFetcher
from .policy import DEFAULT_POLICY, CachePolicy, make_policy
from .slots import SlotTable
from .stats import CacheStats
from .store import DiskExperts, ExpertLayout


def pool_experts(layout: ExpertLayout, pool: dict[str, torch.Tensor]):
    """The pool seen as the experts module of S experts that computes with it: `PoolExperts` (floating point), or a
    `QuantizedExperts` whose buffers are the pool's tensors (int8 experts)."""
    if not layout.dtypes:
        return PoolExperts(layout, pool)
    slots = next(iter(pool.values())).shape[0]
    h, i = layout.shapes["down_proj"]
    with torch.device("meta"):  # no memory: the buffers are the pool's
        experts = QuantizedExperts(slots, h, i, layout.glu, layout.bias, layout.activation, layout.group_size)
    for name, tensor in pool.items():
        experts._buffers[name] = tensor
    return experts


def compute(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """[N, H] through the pool's experts (`pool_experts`), top_k_index [N, k] holding slots (-1: not this pass)."""
    if isinstance(experts, QuantizedExperts):
        return experts(hidden_states, top_k_index, top_k_weights)
    return experts_forward(experts, hidden_states, top_k_index, top_k_weights)


class PoolExperts:
    """The pool seen as a fused-experts module with S experts: the attributes `experts_forward` reads."""

    def __init__(self, layout: ExpertLayout, pool: dict[str, torch.Tensor]):
        self.num_experts = next(iter(pool.values())).shape[0]
        self.has_gate, self.has_bias, self.is_transposed = layout.glu, layout.bias, False
        self.activation = layout.activation
        self.act_fn = ACT2FN[layout.activation]
        up = "gate_up_proj" if layout.glu else "up_proj"
        setattr(self, up, pool[up])
        setattr(self, f"{up}_bias", pool.get(f"{up}_bias"))
        self.down_proj = pool["down_proj"]
        self.down_proj_bias = pool.get("down_proj_bias")


class ExpertCache:
    """Resident experts within a byte budget, for every MoE layer of one model.

    Args:
        store: where the experts are read from (`DiskExperts` or `HostExperts`).
        layout: the experts' tensors (`ExpertLayout`).
        budget: bytes the pool may take.
        gates: each MoE layer's router, in layer order (to predict the next layer's experts).
        policy: "next_use" (default, chosen by measurement: see policy.py), "lfu", "lfu_decay", "lru", or a
            `CachePolicy`.
        prefetch: fetch the experts the next layer's router predicts while a layer computes. None (default): on
            for a GPU cache (copies on a side stream use the copy engine, not the compute), off for a CPU cache,
            where a read is a memcpy on the cores that compute and its wrong guesses are extra reads: there prefetching
            slowed decoding (docs/offload.md, benchmarks/offload.py).
        fetcher_class: how reads reach the slots (default: `ThreadFetcher` on CPU, `CudaStreamFetcher` on CUDA).
    Attributes:
        stats: `CacheStats` (hit rate, prefetch accuracy, bytes read, time waited).
        trace: None, or a list that receives [layer, experts used, experts predicted for layer + 1] per forward.
    """

    def __init__(
        self,
        store,
        layout: ExpertLayout,
        budget: int,
        gates: Sequence[torch.nn.Module],
        device: torch.device,
        dtype: torch.dtype,
        policy: str | CachePolicy = DEFAULT_POLICY,
        prefetch: bool | None = None,
        fetcher_class=None,
    ):
        self.store, self.layout, self.budget = store, layout, budget
        self._fetcher_class = fetcher_class  # None: a thread on CPU, a side stream on CUDA
        self.gates = list(gates)  # a plain list: the routers stay submodules of their blocks only
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.prefetch_setting = prefetch
        self.stats = CacheStats()
        self.trace: list | None = None
        self.device = self.dtype = None
        self._pending: dict[int, object] = {}
        self._allocate(torch.device(device), dtype)

    # ------------------------------------------------------------------------------------------------------------
    # Pool
    # ------------------------------------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.table.num_slots

    @property
    def source(self) -> str:
        """The checkpoint directory the experts come from."""
        return self.store.directory

    def pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pool.values())

    def follow(self, hidden_states: torch.Tensor) -> None:
        """Move the pool to the hidden states' device and dtype if the model moved (`model.to(...)`); the cache
        starts empty there."""
        if hidden_states.device != self.device or hidden_states.dtype != self.dtype:
            self._allocate(hidden_states.device, hidden_states.dtype)

    def _allocate(self, device: torch.device, dtype: torch.dtype) -> None:
        if isinstance(self.store, DiskExperts) and device.type != "cpu":
            raise ValueError(
                f"offload_experts='disk' computes the experts on the CPU, but the model runs on {device}. On a GPU, "
                "load with offload_experts='cpu' (experts in pinned host memory, a cache on the GPU)."
            )
        self._drain()
        expert_bytes = self.layout.expert_bytes(dtype)
        total = self.layout.num_layers * self.layout.num_experts
        slots = expert_slots(self.budget, expert_bytes, self.layout.top_k, total)
        room = None if size_check_skipped() else free_memory(device)
        if room is not None and slots * expert_bytes > room:  # (a CUDA pool is taken at once; a CPU one as it fills)
            raise ValueError(
                f"max_expert_memory={format_size(self.budget)} makes a cache of {slots} expert(s) of "
                f"{format_size(expert_bytes)}: {format_size(slots * expert_bytes)}, but {format_size(room)} of memory "
                f"is free on {device}. Give a smaller max_expert_memory; or, if you know it fits, set "
                f"{SKIP_VARIABLE}=1."
            )
        self.device, self.dtype = device, dtype
        self.prefetch = device.type == "cuda" if self.prefetch_setting is None else self.prefetch_setting
        self.pool = {
            name: torch.empty((slots, *shape), dtype=self.layout.dtype_of(name, dtype), device=device)
            for name, shape in self.layout.shapes.items()
        }
        self.pool_experts = pool_experts(self.layout, self.pool)
        self.table = SlotTable(slots, self.policy)
        self._locked: set[int] = set()  # slots the running layer computes with
        self._pinned_for: dict[int, set[int]] = {}  # layer -> slots kept for it (predicted), until it runs
        self._ahead: dict[int, set[tuple[int, int]]] = {}  # layer -> experts fetched ahead for it
        read = self.store.read_into
        if self._fetcher_class is not None:
            self.fetcher = self._fetcher_class(read)
        else:
            self.fetcher = CudaStreamFetcher(read, device) if device.type == "cuda" else ThreadFetcher(read)
        self._fetch_bytes = self.layout.expert_bytes(self.store.dtype())

    def _views(self, slot: int) -> dict[str, torch.Tensor]:
        return {name: t[slot] for name, t in self.pool.items()}

    def _pinned(self) -> set[int]:
        pinned = self._locked | self._pending.keys()
        for slots in self._pinned_for.values():
            pinned |= slots
        return pinned

    # ------------------------------------------------------------------------------------------------------------
    # One layer's forward
    # ------------------------------------------------------------------------------------------------------------
    def begin(self, layer: int, experts: list[int]) -> list[list[int]]:
        """Layer `layer` computes with `experts` (sorted expert ids). Returns them in passes of at most S, the
        resident ones first; one pass unless the tokens in flight picked more experts than the cache holds."""
        self._retire_finished()
        self._pinned_for.pop(layer, None)
        ahead = self._ahead.pop(layer, set())
        resident = [e for e in experts if (layer, e) in self.table]
        used_ahead = sum((layer, e) in ahead for e in experts)
        stats = self.stats
        stats.uses += len(experts)
        stats.hits += len(resident)
        stats.prefetches_used += used_ahead
        self.policy.visit(layer, self.layout.num_layers)
        for e in experts:
            self.policy.use((layer, e))
        if self.trace is not None:
            self.trace.append([layer, list(experts), []])
        order = resident + [e for e in experts if (layer, e) not in self.table]
        s = self.table.num_slots
        return [order[i : i + s] for i in range(0, len(order), s)]

    def acquire(self, layer: int, experts: list[int], ahead: list[int] | None = None) -> torch.Tensor:
        """Make `experts` of `layer` resident and pinned; while reading them, fetch `ahead` (experts of layer + 1,
        see `predict`) as far as unpinned slots allow. Returns [E] int64 on the device: the slot of each of
        `experts`, -1 elsewhere."""
        keys = [(layer, e) for e in experts]
        slots, misses = [], []
        for key in keys:  # pin the resident ones first, so that placing the misses cannot evict them
            slot = self.table.slot_of.get(key)
            if slot is not None:
                self._locked.add(slot)
            slots.append(slot)
        for i, key in enumerate(keys):
            if slots[i] is None:
                slots[i] = self._place_for_demand(key)
                self._locked.add(slots[i])
                misses.append(i)
        if ahead:
            self._fetch_ahead(layer + 1, ahead)
        start = time.perf_counter()
        try:
            for i in misses:
                self._read_now(keys[i], slots[i])
            for slot in slots:
                if slot in self._pending:
                    self._wait(slot)
        except BaseException:  # nothing half-read may stay resident: forget this pass's misses
            for i in misses:
                self._forget(slots[i])
            raise
        finally:
            self.stats.wait_s += time.perf_counter() - start
        remap = torch.full((self.layout.num_experts,), -1, dtype=torch.int64)
        remap[experts] = torch.tensor(slots, dtype=torch.int64)
        return remap.to(self.device, non_blocking=True)

    def release(self) -> None:
        """The running pass is done with its slots."""
        for slot in self._locked:
            self.fetcher.released(slot)
        self._locked.clear()

    # ------------------------------------------------------------------------------------------------------------
    # Fetching
    # ------------------------------------------------------------------------------------------------------------
    def predict(self, layer: int, hidden_states: torch.Tensor) -> list[int] | None:
        """The experts layer `layer`'s router picks for `hidden_states` [N, H] (the previous layer's input): the
        guess of what to fetch ahead. None when nothing asks for it (prefetch off and no trace), or past the last
        layer. The router's `.forward` rather than a module call: no hooks (ZeRO-3's, the user's) run for a guess,
        and, called outside its block, it is not recorded as a routing."""
        if layer >= len(self.gates) or not (self.prefetch or self.trace is not None):
            return None
        index = self.gates[layer].forward(hidden_states).top_k_index
        predicted = index[index >= 0].unique().tolist()  # host sync: what to read is decided on the host
        if self.trace is not None:
            self.trace[-1][2] = predicted
        return predicted if self.prefetch else None

    def _fetch_ahead(self, layer: int, experts: list[int]) -> None:
        kept, ahead = set(), set()
        self._pinned_for[layer], self._ahead[layer] = kept, ahead
        for e in experts:
            key = (layer, e)
            slot = self.table.slot_of.get(key)
            if slot is not None:
                kept.add(slot)
                continue
            placed = self.table.place(key, self._pinned())
            if placed is None:
                break  # every slot is in use or kept: fetch no further ahead
            slot, evicted = placed
            self.stats.evictions += evicted is not None
            self.stats.prefetches += 1
            self.stats.bytes_read += self._fetch_bytes
            kept.add(slot)
            ahead.add(key)
            self._pending[slot] = self.fetcher.start(layer, e, self._views(slot), slot)

    def _place_for_demand(self, key) -> int:
        placed = self.table.place(key, self._pinned())
        if placed is None:  # everything is pinned: let the reads in flight finish, then drop the guesses
            self._drain()
            placed = self.table.place(key, self._pinned())
        if placed is None:
            self._pinned_for.clear()
            placed = self.table.place(key, self._pinned())
        if placed is None:
            raise RuntimeError(f"No free slot for expert {key} among {self.table.num_slots}: this is a bug in hf_moe.")
        slot, evicted = placed
        self.stats.evictions += evicted is not None
        self.stats.demand_fetches += 1
        self.stats.bytes_read += self._fetch_bytes
        return slot

    def _read_now(self, key, slot: int) -> None:
        self.fetcher.run(*key, self._views(slot), slot)

    def _wait(self, slot: int) -> None:
        handle = self._pending.pop(slot)
        try:
            self.fetcher.wait(handle)
        except BaseException:
            self._forget(slot)
            raise

    def _forget(self, slot: int) -> None:
        """A read into `slot` failed: the slot holds nothing usable."""
        key = self.table.key_of[slot]
        if key is None:
            return
        self.table.drop(key)
        self._locked.discard(slot)
        for slots in self._pinned_for.values():
            slots.discard(slot)
        for keys in self._ahead.values():
            keys.discard(key)

    def _retire_finished(self) -> None:
        for slot, handle in list(self._pending.items()):
            if self.fetcher.done(handle):
                self._wait(slot)

    def _drain(self) -> None:
        """Wait for every read in flight (the first failure is raised after all have finished)."""
        error = None
        for slot in list(self._pending):
            try:
                self._wait(slot)
            except BaseException as err:  # noqa: PERF203
                error = error or err
        if error is not None:
            raise error

    def close(self) -> None:
        self._drain()
        self.store.close()

    def __repr__(self) -> str:
        return (
            f"ExpertCache({self.num_slots} slots of {self.layout.num_layers * self.layout.num_experts} experts, "
            f"{self.pool_bytes() / 2**20:.1f} MiB on {self.device}, policy={self.policy.name}, "
            f"prefetch={self.prefetch})"
        )
