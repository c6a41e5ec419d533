"""Context optimization: what of a request's context reaches the model, under a token budget.

Pure functions over messages, passages and the model's tokenizer, shared by the HTTP server and the Python API:
:func:`truncate_prompt` (``truncate_prompt_tokens``), :func:`trim_history` (chat history under
``max_prompt_tokens`` / ``keep_last_turns``), :func:`select_passages` and :func:`build_messages` (RAG passages:
de-duplication, BM25, ``max_context_tokens`` / ``top_k``, "lost in the middle"), :func:`prepare_chat` (both, then
the chat template: what the server and ``LLM.chat`` run), and the answer cache
(:class:`AnswerCache`: an LRU bounded in bytes with a TTL).
"""

from leanserve.context.answer_cache import AnswerCache, CacheEntry, is_deterministic
from leanserve.context.chat import PreparedChat, prepare_chat
from leanserve.context.history import TrimmedHistory, count_tokens, split_turns, trim_history
from leanserve.context.passages import (
    Passage,
    PassageSelection,
    bm25_scores,
    build_messages,
    deduplicate,
    last_user_text,
    lost_in_the_middle,
    select_passages,
)
from leanserve.context.truncate import truncate_prompt, truncation_size

__all__ = [
    "AnswerCache", "CacheEntry", "Passage", "PassageSelection", "PreparedChat", "TrimmedHistory", "bm25_scores",
    "build_messages", "count_tokens", "deduplicate", "is_deterministic", "last_user_text", "lost_in_the_middle",
    "prepare_chat", "select_passages", "split_turns", "trim_history", "truncate_prompt", "truncation_size",
]
