#!/usr/bin/env python
"""Generate text with a GGUF model: see `python scripts/generate.py --help`."""

import sys

from fucina_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
