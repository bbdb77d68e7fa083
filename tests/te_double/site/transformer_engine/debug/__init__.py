"""TEST DOUBLE of ``transformer_engine.debug``: TE's precision-debug tools as the recipe uses them
(TE 2.20.2), run by the real ``nvdlfw_inspect`` (its config reader, layer selection, feature
registry, API routing, step counter and statistics loggers).

What the double's GEMMs report (``pytorch/debug_state.inspect_gemm_operand``) and which
statistics its features offer are TE's names; ``features/`` is the directory the recipe hands to
``debug_api.initialize(feature_dirs=...)``, as it does TE's own.
"""
