"""``python -m ravnest_jax.cli COMMAND ...``: the ``ravnest-jax`` command."""

import sys

from ravnest_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
