"""Tools over the engine: ``plan`` (memory arithmetic) and ``eval`` (the quality gate for quantization)."""
