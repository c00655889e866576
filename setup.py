"""Build of the native parts with the system compilers; metadata lives in pyproject.toml.

- fucina_jax/index/sam.c: the suffix automaton's C core.
- fucina_jax/gguf_strings.c: a GGUF header's string arrays (the vocabulary) in one C pass.
- fucina_jax/kernels/qmatmul.cc (+ fmatmul.cc, attention.cc, select.cc, pack.cc): quantized and float matmul
  kernels called from jax.jit through the XLA FFI, and loading's packing loops. Compiled against the FFI headers
  jaxlib ships (a build requirement), for the generic x86-64 baseline: the AVX2 and AVX-512 functions carry
  target attributes and are picked at run time, so one build runs on any x86-64 CPU.

A plain CPython extension module rather than a ctypes library: a method call costs ~50 ns instead of the
~1 us a ctypes call with NumPy arguments costs, which is what keeps append+suggest within the per-token
budget. setuptools builds it in place for `pip install -e .` and into the wheel for a regular install.
"""

import os

from setuptools import Extension, setup

# -O2 is what the per-token budget was measured with; MSVC takes its own defaults.
_CFLAGS = [] if os.name == "nt" else ["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"]

# -ffp-contract=off: the kernels' float sequence (explicit fma steps) must be the same on every path; never fast-math.
_CXXFLAGS = [] if os.name == "nt" else ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-math-errno", "-Wall",
                                      "-Wno-maybe-uninitialized"]  # GCC 12 false positive in its own intrinsics headers


def _ffi_include() -> str:
    import jaxlib

    return os.path.join(os.path.dirname(jaxlib.__file__), "include")


setup(
    ext_modules=[
        Extension(
            "fucina_jax.index._sam",
            sources=["fucina_jax/index/sam.c"],
            extra_compile_args=_CFLAGS,
        ),
        Extension(
            "fucina_jax._gguf_strings",
            sources=["fucina_jax/gguf_strings.c"],
            extra_compile_args=_CFLAGS,
        ),
        Extension(
            "fucina_jax.kernels._qmatmul",
            sources=["fucina_jax/kernels/qmatmul.cc", "fucina_jax/kernels/fmatmul.cc", "fucina_jax/kernels/attention.cc",
                     "fucina_jax/kernels/select.cc", "fucina_jax/kernels/pack.cc"],
            depends=["fucina_jax/kernels/parallel.h"],
            extra_compile_args=_CXXFLAGS + ["-isystem", _ffi_include()],  # system: no warnings from XLA's headers
            language="c++",
            # x86-64 only (AVX-512/AVX2 intrinsics): where it cannot build, the package installs without it and
            # runs the f32 reference path (fucina_jax.kernels.available() is False)
            optional=True,
        ),
    ],
)
