"""The build step pyproject.toml cannot say declaratively: the small-row CPU kernel
(runtime/model/csrc/small_rows.c, see runtime/model/small_rows.py) compiled by the build backend into
runtime/model/_small_rows*.so, with the sha256 of the source it was compiled from embedded
(`small_rows_source_sha()`), so the runtime refuses a build older than its source.

The extension is optional: where there is no C compiler, or it fails, the install still succeeds
and the runtime keeps torch's products (`runtime.model.small_rows.available()` is False and says why).
Off Linux x86-64 it is not attempted (the kernel needs AVX2 + FMA and OpenMP through gcc/clang).
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "runtime/model/csrc/small_rows.c"


def small_rows_extension() -> list[Extension]:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return []
    sha = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()
    return [Extension(
        "runtime.model._small_rows",
        sources=[SOURCE],
        define_macros=[("SMALL_ROWS_SOURCE_SHA", f'"{sha}"')],
        # no -ffast-math (or anything allowing reassociation): the sums' order is the kernel's contract
        extra_compile_args=["-O3", "-mavx2", "-mfma", "-fopenmp", "-Werror=implicit-function-declaration"],
        extra_link_args=["-fopenmp", "-Wl,--no-undefined"],
        libraries=["m"],
        optional=True,  # no compiler (or a failing one): install anyway, the runtime falls back to torch
    )]


setup(ext_modules=small_rows_extension())
