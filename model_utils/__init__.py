"""The recipe's parts, one concern per module (README, "Map of the code", maps them)."""

import logging


class _ImportNoise(logging.Filter):
    """Lines other libraries print as they are imported that say nothing about a run, dropped
    by their exact words (every other line of the same logger passes): torchao's for each of
    its C++ kernel libraries that cannot load here (CUDA- and GPU-specific; the recipe's
    torchao FP8 training and low-bit AdamW call none of them), its "no triton" warning (for
    its int8 matmul kernels, which the recipe never runs), and torch's deprecation of the
    pytree registration torchao's import makes."""

    def __init__(self, *words: str) -> None:
        super().__init__()
        self.words = words

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not all(word in message for word in self.words)


logging.getLogger("torchao").addFilter(_ImportNoise("Failed to load ", "/torchao/_C"))
logging.getLogger("torchao.kernel.intmm").addFilter(_ImportNoise("Detected no triton"))
logging.getLogger("torch.utils._pytree").addFilter(
    _ImportNoise("is an Enum subclass and is now natively supported")
)
