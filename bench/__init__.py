"""The benchmark ladder (bench/ladder.py) and the rungs it composes from the stage scripts (bench/rungs.py)."""
