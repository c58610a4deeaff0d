"""Build corechat's kernels for this CPU into the virtualenv: `python -m service.engine.kernels`."""

import logging

from . import available_paths, load

logging.basicConfig(level=logging.INFO, format="%(message)s")
print(f"{load()} ({', '.join(available_paths())})")
