"""TEST DOUBLE of ``transformer_engine.debug.pytorch``."""
