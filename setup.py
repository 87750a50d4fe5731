"""Only the optional compiled extension lives here; everything else is in pyproject.toml.

    HF_MOE_BUILD_EXT=1 pip install --no-build-isolation -e .

builds hf_moe._C (the C++ CPU kernels) ahead of time. Without the variable nothing is compiled at install time,
and hf_moe builds the same sources on first use (hf_moe/ops/extension.py). The GPU kernels are Triton
(hf_moe/ops/triton/), compiled by Triton when they first run.
"""

import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("HF_MOE_BUILD_EXT") == "1":
    import importlib.util
    import sys

    from torch.utils.cpp_extension import BuildExtension, CppExtension

    # The sources (every *.cpp under csrc/, found on disk) and flags, from the module that also does the on-first-use
    # build (torch is its only import).
    spec = importlib.util.spec_from_file_location("_hf_moe_extension", "hf_moe/ops/extension.py")
    ext = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)

    stamp = f'-DHF_MOE_SOURCE_HASH="{ext.source_hash()}"'  # lets the loader spot a stale build
    ext_modules = [
        CppExtension(
            "hf_moe._C",
            [f"csrc/{s}" for s in ext.CPU_SOURCES],
            # -g0: no debug info, as in the on-first-use build. setuptools passes Python's CFLAGS, whose -g makes
            # each object tens of times bigger and its compile slower (docs/backends.md), for the same code.
            extra_compile_args=ext.CXX_FLAGS + [stamp, "-g0"],
            extra_link_args=["-fopenmp"],
        )
    ]
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
