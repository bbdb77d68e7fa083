"""A script run with a Python that lacks the project's environment (the system's `python3`, a
run by path from elsewhere) says so in one line and exits 2, instead of a ModuleNotFoundError
traceback. Imported first by the scripts that need torch and the recipe; checks on import.
Standard library only."""

from __future__ import annotations

import sys
from pathlib import Path

#: What every such script imports: the libraries, then the recipe's package.
NEEDED = ("torch", "transformers", "model_utils")


def require_environment(script: str) -> None:
    for module in NEEDED:
        try:
            __import__(module)
        except ModuleNotFoundError as missing:
            print(
                f"{script}.py: error: {sys.executable} has no module {missing.name!r}: run "
                f".venv/bin/python -m scripts.{script} (the environment make creates)",
                file=sys.stderr,
            )
            sys.exit(2)


require_environment(Path(sys.argv[0]).stem)
