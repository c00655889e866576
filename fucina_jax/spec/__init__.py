"""Deprecated alias of `fucina_jax.speculative` (renamed: "spec" also meant "specification" in this codebase).

`import fucina_jax.spec` and `from fucina_jax.spec.gate import ...` keep working for one release, with a
DeprecationWarning; so do the names it used to export that moved elsewhere (the drivers to fucina_jax.generate,
the statistics and the row hook to fucina_jax.decoder, the top-K width to fucina_jax.engine).
"""

import importlib
import sys
import warnings

warnings.warn("fucina_jax.spec is deprecated: import fucina_jax.speculative (policy, sources), fucina_jax.decoder "
              "or fucina_jax.generate (generate_speculative, generate_batched) instead", DeprecationWarning,
              stacklevel=2)

from fucina_jax.decoder import SpecStats, VerifyRowHook  # noqa: E402,F401
from fucina_jax.engine import TOPK_FEEDBACK  # noqa: E402,F401
from fucina_jax.generate import generate_batched, generate_speculative  # noqa: E402,F401
from fucina_jax.speculative import *  # noqa: E402,F401,F403
from fucina_jax.speculative import __all__ as _moved_here  # noqa: E402

__all__ = [*_moved_here, "SpecStats", "VerifyRowHook", "TOPK_FEEDBACK", "generate_speculative", "generate_batched"]

_SUBMODULES = ("bench", "cost_table", "gate", "sources")

for _name in _SUBMODULES:  # `from fucina_jax.spec.gate import X` finds the renamed module
    sys.modules.setdefault(f"{__name__}.{_name}", importlib.import_module(f"fucina_jax.speculative.{_name}"))
