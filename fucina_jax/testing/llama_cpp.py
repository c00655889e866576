"""llama.cpp (through llama-cpp-python), the reference of the parity tests and the baseline of the benchmarks, opened
so that it runs on every CPU this project runs on."""

from __future__ import annotations

import functools

__all__ = ["amx_build", "open_llama_cpp"]


@functools.cache
def amx_build() -> bool:
    """True when the installed llama.cpp was compiled with its AMX backend (llama_print_system_info: AMX_INT8 = 1)."""
    import llama_cpp

    return b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info()


def open_llama_cpp(path: str, **kw):
    """llama_cpp.Llama(path, **kw), with llama.cpp's extra buffer types off where its build has the AMX backend.

    llama.cpp's AMX matmul (ggml_backend_amx_mul_mat) segfaults on the first decode on some AMX machines: seen here on
    a 2-core AMX-INT8 Xeon VM with the embedded Gemma 3 270M Q4_K_M and every Q4_0/Q8_0 fixture (llama.cpp issue
    #20824, machine-dependent, closed unfixed). The extra buffer types are AMX and CPU_REPACK; without them llama.cpp
    runs its plain CPU kernels, which are slower but right. A llama.cpp built without AMX (-mno-amx-*, see the
    README) keeps CPU_REPACK: this changes nothing for it.
    """
    import llama_cpp
    import llama_cpp.llama as module

    if kw.get("vocab_only") or not amx_build():
        return llama_cpp.Llama(path, **kw)
    default = module.llama_cpp.llama_model_default_params

    def without_extra_buffers():
        params = default()
        params.use_extra_bufts = False
        return params

    module.llama_cpp.llama_model_default_params = without_extra_buffers
    try:
        return llama_cpp.Llama(path, **kw)
    finally:
        module.llama_cpp.llama_model_default_params = default
