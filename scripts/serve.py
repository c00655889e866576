#!/usr/bin/env python
"""An OpenAI-compatible HTTP server for a GGUF model: see `python scripts/serve.py --help`."""

import sys

from fucina_jax.serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
