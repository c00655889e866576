"""Build of the C core (fucina_jax/index/sam.c) with the system C compiler; metadata lives in pyproject.toml.

A plain CPython extension module rather than a ctypes library: a method call costs ~50 ns instead of the
~1 us a ctypes call with NumPy arguments costs, which is what keeps append+suggest within the per-token
budget. setuptools builds it in place for `pip install -e .` and into the wheel for a regular install.
"""

import os

from setuptools import Extension, setup

# -O2 is what the per-token budget was measured with; MSVC takes its own defaults.
_CFLAGS = [] if os.name == "nt" else ["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"]

setup(
    ext_modules=[
        Extension(
            "fucina_jax.index._sam",
            sources=["fucina_jax/index/sam.c"],
            extra_compile_args=_CFLAGS,
        )
    ],
)
