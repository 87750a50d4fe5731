"""What the expert cache did (hits, prefetches, bytes read, time waited), and the process's peak memory."""

from __future__ import annotations

import resource
import time
import sys
from dataclasses import dataclass, fields


@dataclass
class CacheStats:
    """Counts since the cache was built or last `reset()`.

    A *use* is one expert of one layer needed by one forward (however many tokens it computes). It is a *hit* when
    the expert was resident, or already on its way because a prefetch asked for it, when the layer asked.
    """

    uses: int = 0
    hits: int = 0
    demand_fetches: int = 0  # misses: read while the layer waited
    prefetches: int = 0  # experts fetched ahead for the next layer
    prefetches_used: int = 0  # of which that layer then used (each one a hit a cache without prefetch misses)
    evictions: int = 0
    bytes_read: int = 0
    wait_s: float = 0.0  # time the forward spent waiting for expert reads (demand reads and unfinished prefetches)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.uses if self.uses else 0.0

    @property
    def prefetch_accuracy(self) -> float:
        """Fraction of the experts fetched ahead that the next layer used."""
        return self.prefetches_used / self.prefetches if self.prefetches else 0.0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)

    def summary(self) -> str:
        text = f"expert cache hit rate {100 * self.hit_rate:.1f}% ({self.hits}/{self.uses} expert uses)"
        if self.prefetches:
            text += (
                f", prefetch accuracy {100 * self.prefetch_accuracy:.1f}% ({self.prefetches_used}/{self.prefetches}), "
                f"so {self.prefetches_used} of the hits"
            )
        return text + f", {self.bytes_read / 2**20:.0f} MiB read, {self.wait_s:.2f}s waiting for reads"


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM on Linux; ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class GenerationTimer:
    """A `generate(streamer=...)` streamer that timestamps the prompt and every new token (and prints the text as
    it comes when given a tokenizer). generate calls `put` with the prompt before the prefill, then once per step.

    prefill_s: prompt put -> first new token (the prefill forward); decode_tokens_per_s: the steps after it.
    """

    def __init__(self, tokenizer=None):
        from transformers import TextStreamer

        self.times: list[float] = []
        self.text = (
            TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if tokenizer is not None else None
        )

    def put(self, value) -> None:
        self.times.append(time.perf_counter())
        if self.text is not None:
            self.text.put(value)

    def end(self) -> None:
        if self.text is not None:
            self.text.end()

    @property
    def prefill_s(self) -> float:
        return self.times[1] - self.times[0]

    @property
    def new_tokens(self) -> int:
        return len(self.times) - 1

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.times) - 2
        return steps / (self.times[-1] - self.times[1]) if steps > 0 else float("nan")
