#!/usr/bin/env python
"""Generate text with a GGUF model: see `python scripts/generate.py --help`."""

import os
import sys

from fucina_jax.cli import main

if __name__ == "__main__":
    rc = main()
    # Nothing is left to do once main returns (the compiled-step store and JAX's cache are written synchronously),
    # but the interpreter's teardown of JAX's runtime and the model's objects takes 0.35-0.5 s: exit at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
