"""TEST DOUBLE of ``transformer_engine.common`` (recipes only)."""
