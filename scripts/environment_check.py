"""A script run with a Python that lacks the project's environment (the system's `python3`, a
run by path from elsewhere) says so in one line and exits 2, instead of a ModuleNotFoundError
traceback (and Ctrl-C while the libraries load is one line, not an import's traceback). Run
by path (runpy) first by each command that needs torch and the recipe, in
scripts/ and analysis/, when it runs as a command. Standard library only."""

from __future__ import annotations

import sys
from pathlib import Path

#: What every such script imports: the libraries, then the recipe's package.
NEEDED = ("torch", "transformers", "model_utils")
script = Path(sys.modules["__main__"].__file__)  # the command: its folder and name

for module in NEEDED:
    try:
        __import__(module)
    except KeyboardInterrupt:  # Ctrl-C in the seconds torch takes to load: nothing began
        sys.exit(print(f"{script.name}: error: interrupted while loading", file=sys.stderr) or 130)
    except ModuleNotFoundError as missing:
        print(
            f"{script.name}: error: {sys.executable} has no module {missing.name!r}: run .venv/bin/"
            f"python -m {script.parent.name}.{script.stem} (the environment make creates)",
            file=sys.stderr,
        )
        sys.exit(2)
