"""The compiled decode modes of benchmarks/serve_cpu.py (run by serve_worker.py) and benchmarks/decode_profile.py:
mode -> hf_moe.generation.decode_compile_config's arguments (serve_worker.py's docstring says what each runs).
No torch here: serve_cpu.py's parent process reads the names without loading it."""

from __future__ import annotations

import warnings

FREEZING = {"freezing": True}
MODES = {
    "compiled": dict(hf_moe_step=False, options={}),
    "cpp_wrapper": dict(hf_moe_step=False, options={"cpp_wrapper": True}),
    "freezing": dict(hf_moe_step=False, options=FREEZING),
    "max_autotune": dict(hf_moe_step=False, options={**FREEZING, "max_autotune": True,
                                                     "max_autotune_gemm_backends": "CPP,ATEN"}),
    "hf_moe_step": dict(hf_moe_step=True),
    "attention_block": dict(hf_moe_step=True, one_op=False),
    "attention_block_python": dict(hf_moe_step=True, options={}, one_op=False),
    "attention_block_checked": dict(hf_moe_step=True, skip_guards=False, one_op=False),
}
HF_MOE_MODES = {name for name, settings in MODES.items() if settings["hf_moe_step"]}  # transformers' models skip them
# the modes' former names ("fused" is the word for stacked expert weights only), accepted for one release
FORMER_MODES = {"fused": "hf_moe_step", "fused_compiled": "attention_block",
                "fused_python": "attention_block_python", "fused_checked": "attention_block_checked"}


def mode_names(text: str) -> list[str]:
    """--modes' comma-separated names, each former name replaced by its name now with a DeprecationWarning."""
    names = []
    for name in text.split(","):
        if name in FORMER_MODES:
            warnings.warn(f"the mode {name!r} is now {FORMER_MODES[name]!r}; {name!r} is deprecated",
                          DeprecationWarning, stacklevel=2)
            name = FORMER_MODES[name]
        names.append(name)
    return names
