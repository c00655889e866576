"""Deprecated alias of `fucina_jax.speculative` (renamed: "spec" also meant "specification" in this codebase).

`import fucina_jax.spec` and `from fucina_jax.spec.gate import ...` keep working for one release, with a
DeprecationWarning; import `fucina_jax.speculative` instead.
"""

import importlib
import sys
import warnings

warnings.warn("fucina_jax.spec is deprecated: import fucina_jax.speculative instead", DeprecationWarning,
              stacklevel=2)

from fucina_jax.speculative import *  # noqa: E402,F401,F403
from fucina_jax.speculative import __all__  # noqa: E402,F401

_SUBMODULES = ("bench", "cost_table", "gate")


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"fucina_jax.speculative.{name}")
    raise AttributeError(f"module 'fucina_jax.spec' has no attribute {name!r}")


for _name in _SUBMODULES:  # `from fucina_jax.spec.gate import X` finds the renamed module
    sys.modules.setdefault(f"{__name__}.{_name}", importlib.import_module(f"fucina_jax.speculative.{_name}"))
