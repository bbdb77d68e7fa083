"""The recipe's parts, one concern per module (README, "Map of the code", maps them)."""

import logging

# torchao logs a warning per CUDA-only kernel library it cannot load on a CPU machine, and torch
# warns about a deprecated pytree registration inside torchao. Neither says anything about the
# user's run, and both would bury the one-line error messages train.py promises.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
