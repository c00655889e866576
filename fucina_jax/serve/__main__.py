"""`python -m fucina_jax.serve [MODEL.gguf] [--host ...] [--port ...]`: see fucina_jax/serve/cli.py."""

import sys

from fucina_jax.serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
