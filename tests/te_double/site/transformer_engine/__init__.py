"""TEST DOUBLE of ``transformer_engine`` (tests/te_double): pure PyTorch, runs on CPU.

Only the API subset this project calls, with the signatures of the pinned release (checked by
tests/integration/test_te_contract.py). Never installed; tests put ``tests/te_double/site`` on
the path.
"""

import os

from transformer_engine import common  # noqa: F401  (the real package imports it too)

#: The release this double mirrors (the pinned one unless ``TE_DOUBLE_VERSION`` names another,
#: e.g. the image's 2.16.0), marked as a double in the local version segment.
__version__ = os.environ.get("TE_DOUBLE_VERSION", "2.20.2") + "+double"
