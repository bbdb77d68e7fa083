"""TEST DOUBLE of ``transformer_engine`` (tests/te_double): pure PyTorch, runs on CPU.

Only the API subset this project calls, with the signatures of the pinned release (checked by
tests/test_te_contract.py). Never installed; tests put ``tests/te_double/site`` on the path.
"""

from transformer_engine import common  # noqa: F401  (the real package imports it too)

#: The pinned release this double mirrors, marked as a double in the local version segment.
__version__ = "2.20.2+double"
