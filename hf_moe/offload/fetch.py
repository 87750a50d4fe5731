"""How a read reaches a cache slot: on a background thread (CPU cache), or on a CUDA side stream (GPU cache).

Both take `read(layer, expert, dst)` (a store's `read_into`) and return a handle per fetch that the cache waits on
before the slot is computed with.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class ThreadFetcher:
    """Fetches ahead on one I/O thread; `pread` and tensor copies release the GIL, so they overlap the forward.
    Demand fetches run on the calling thread, beside the prefetches. A handle is a `Future`."""

    def __init__(self, read):
        self.read = read
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hf_moe-experts")
        weakref.finalize(self, self._executor.shutdown, wait=True)

    def start(self, layer: int, expert: int, dst: dict[str, torch.Tensor], slot: int) -> Future:
        return self._executor.submit(self.read, layer, expert, dst)

    def run(self, layer: int, expert: int, dst: dict[str, torch.Tensor], slot: int) -> None:
        self.read(layer, expert, dst)

    def done(self, handle: Future) -> bool:
        return handle.done()

    def wait(self, handle: Future) -> None:
        handle.result()  # re-raises a failed read here, in the forward

    def released(self, slot: int) -> None:
        pass  # CPU compute is finished when the forward returns


class CudaStreamFetcher:
    """Copies from pinned host memory to the GPU cache on a side stream, so they overlap the compute stream.

    NOT RUN HERE: CI has no GPU. The logic around it (what is fetched, when, into which slot, what is evicted) is
    the cache's, and runs in the tests with `ThreadFetcher`. Only this class's stream and event calls are untested:
      - a fetch waits (on the side stream) for the compute that last read its slot, then copies, then records;
      - the compute stream waits for that record before it reads the slot; the host never waits.
    """

    def __init__(self, read, device: torch.device):
        self.read = read
        self.stream = torch.cuda.Stream(device)
        self._slot_free: dict[int, torch.cuda.Event] = {}

    def start(self, layer: int, expert: int, dst: dict[str, torch.Tensor], slot: int) -> torch.cuda.Event:
        with torch.cuda.stream(self.stream):
            free = self._slot_free.pop(slot, None)
            if free is not None:
                self.stream.wait_event(free)
            self.read(layer, expert, dst)  # non_blocking copies from pinned memory, queued on self.stream
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def run(self, layer: int, expert: int, dst: dict[str, torch.Tensor], slot: int) -> None:
        self.wait(self.start(layer, expert, dst, slot))

    def done(self, handle: torch.cuda.Event) -> bool:
        return handle.query()

    def wait(self, handle: torch.cuda.Event) -> None:
        torch.cuda.current_stream().wait_event(handle)

    def released(self, slot: int) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())  # after the compute that read the slot
        self._slot_free[slot] = event


class InlineFetcher:
    """Reads at once on the calling thread: deterministic, for replaying traces (simulate.py)."""

    def __init__(self, read):
        self.read = read

    def start(self, layer: int, expert: int, dst: dict[str, torch.Tensor], slot: int) -> None:
        self.read(layer, expert, dst)

    def run(self, layer: int, expert: int, dst: dict[str, torch.Tensor], slot: int) -> None:
        self.read(layer, expert, dst)

    def done(self, handle) -> bool:
        return True

    def wait(self, handle) -> None:
        pass

    def released(self, slot: int) -> None:
        pass
