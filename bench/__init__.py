"""corechat's benchmark: `python bench/run.py` (see README, Performance)."""
