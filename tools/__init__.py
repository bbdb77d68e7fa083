"""Developer tools, apart from the commands a user runs (scripts/): `python -m tools.X`."""
