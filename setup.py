"""Only the optional compiled extension lives here; everything else is in pyproject.toml.

    HF_MOE_BUILD_EXT=1 pip install --no-build-isolation -e .

builds hf_moe._C ahead of time (C++ always, CUDA when torch has CUDA and nvcc is found). Without the variable
nothing is compiled at install time, and hf_moe builds the same sources on first use (hf_moe/ops/extension.py).
"""

import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("HF_MOE_BUILD_EXT") == "1":
    import importlib.util
    import shutil
    import sys

    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    # The source lists and flags, from the module that also does the on-first-use build (torch is its only import).
    spec = importlib.util.spec_from_file_location("_hf_moe_extension", "hf_moe/ops/extension.py")
    ext = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    CPU_SOURCES, CUDA_SOURCES, CXX_FLAGS, NVCC_FLAGS = ext.CPU_SOURCES, ext.CUDA_SOURCES, ext.CXX_FLAGS, ext.NVCC_FLAGS

    with_cuda = torch.version.cuda is not None and shutil.which("nvcc") is not None
    sources = [f"csrc/{s}" for s in CPU_SOURCES + (CUDA_SOURCES if with_cuda else [])]
    stamp = f'-DHF_MOE_SOURCE_HASH="{ext.source_hash(with_cuda)}"'  # lets the loader spot a stale build
    extension = CUDAExtension if with_cuda else CppExtension
    ext_modules = [
        extension(
            "hf_moe._C",
            sources,
            extra_compile_args={
                "cxx": CXX_FLAGS + [stamp] + (["-DHF_MOE_WITH_CUDA"] if with_cuda else []),
                "nvcc": NVCC_FLAGS,
            },
            extra_link_args=["-fopenmp"],
        )
    ]
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
