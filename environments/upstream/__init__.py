"""Running upstream Atropos environment files unmodified (envfile.py) and checking them first (probe.py)."""
