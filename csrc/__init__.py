"""C++ (CPU) sources of the compiled ops (installed as hf_moe.csrc, built by hf_moe/ops/extension.py)."""
