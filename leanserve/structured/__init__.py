"""Structured outputs: grammars compiled from JSON schemas, regexes, choices and EBNF (xgrammar), one matcher per
request giving the sampler its allowed-token mask; and the hermes-style tool-call format (``tools``)."""

from leanserve.structured.grammar import GrammarCompiler, GrammarState, apply_token_bitmask

__all__ = ["GrammarCompiler", "GrammarState", "apply_token_bitmask"]
