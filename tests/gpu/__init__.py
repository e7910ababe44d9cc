"""The GPU tier: python -m pytest -q tests/gpu (a package, so that its conftest and the suite's do not collide)."""
