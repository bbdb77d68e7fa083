"""The precision stage: the backends (bf16, torchao FP8, Transformer Engine), what TE needs and
how it is loaded, and master weights."""
