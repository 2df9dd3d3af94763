"""Offline tile-config tuning for a user's shape: `titan-megamoe tune` (cli.py), the search with its
oracle check and resumable table file (search.py, oracle_check.py), the candidates (candidates.py) and
the problem every kernel is timed on (problem.py). `scripts/tune_kernels.py` uses the same candidates
and problems to maintain the shipped table."""
