"""The expert-memory budget: parsing `max_expert_memory`, and how many expert slots it buys."""

from __future__ import annotations

from ..compat import convert_file_size_to_int

_EXAMPLES = "bytes (1073741824) or an integer with a unit: '1GiB', '512MiB', '2GB', '500MB'"


def parse_memory_size(value: int | str, name: str = "max_expert_memory") -> int:
    """A positive number of bytes from an int or a string such as "1GiB", "512MiB", "2GB" or "1073741824".

    Raises:
        TypeError: neither an int nor a string.
        ValueError: unparsable, zero or negative; the message says how to write it.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{name} takes {_EXAMPLES}; got {value!r} ({type(value).__name__}).")
    size = value
    if isinstance(value, str):
        text = value.strip().replace(" ", "")
        try:
            size = int(text) if text.lstrip("+-").isdigit() else convert_file_size_to_int(text)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not a size: write {_EXAMPLES}.") from None
    if size <= 0:
        raise ValueError(f"{name} must be a positive size, got {value!r}: write {_EXAMPLES}.")
    return size


def format_size(num_bytes: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as the budget is usually written)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError


def expert_slots(budget: int, expert_bytes: int, top_k: int, num_experts_total: int) -> int:
    """How many experts a budget of `budget` bytes holds at once, capped at every expert of the model.

    A layer computes a token with k experts resident together, so a budget below k experts cannot run at all.
    """
    slots = budget // expert_bytes
    if slots < top_k:
        need = top_k * expert_bytes
        raise ValueError(
            f"max_expert_memory={format_size(budget)} holds {slots} expert(s), fewer than the {top_k} experts one "
            f"layer needs at once for a token (top-{top_k}, {format_size(expert_bytes)} each): give at least "
            f"{format_size(need)} ({need} bytes)."
        )
    return min(slots, num_experts_total)
