"""The four built-in serving scenarios, made of real offline text (:mod:`leanserve.bench.corpus`: the Python
standard library's sources and docstrings, PSF License) with fixed length distributions and a fixed seed.

Lengths are in tokens of the served model's tokenizer. A request's prompt length is the token count of its
text (the system and user messages joined by a blank line, which is also the prompt sent to /v1/completions);
on /v1/chat/completions the chat template adds a few tokens of framing. Prompt and output lengths are drawn
uniformly from each scenario's ranges; every request generates exactly its output length (``ignore_eos``).

========================  ===================  ==============  ==============================================
scenario                  prompt (tokens)      output          what
========================  ===================  ==============  ==============================================
``customer-service``      200-500              20-80           shared system prompt + short FAQ + a question
``knowledge-qa``          1,500-3,000          100-250         retrieved passages (some near-duplicates) + Q
``code-assistant``        1,000-3,000          100-400         a file's code + an instruction
``copywriting``           50-200               300-800         a short marketing brief
========================  ===================  ==============  ==============================================
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from leanserve.bench.corpus import Corpus

SUPPORT_SYSTEM_PROMPT = (
    "You are Pyla, the support assistant of the Python Help Desk. Answer the customer's question in two or three "
    "short, friendly sentences, using only the FAQ entries given with the question. If the FAQ does not answer "
    "it, say so and offer to open a ticket with a human agent. Never invent function names, options or version "
    "numbers. Do not paste long code; point to the relevant function instead. Keep a polite, calm tone even when "
    "the customer is upset, and never ask for passwords or personal data. End with one short follow-up offer."
)
SUPPORT_QUESTIONS = [
    "Hi, what does {name} actually do? The docs confuse me.",
    "Is {name} the right thing to use for my script, and is there a catch?",
    "My colleague says I should call {name}. When would that be a bad idea?",
    "Quick question: what arguments does {name} take?",
    "I upgraded and {name} behaves differently. What should I check?",
    "Can you explain {name} in plain words?",
]
QA_INSTRUCTION = ("Answer the question using only the documents below. Cite the documents you use by number. "
                  "Some documents may repeat each other.")
QA_QUESTIONS = [
    "Question: What does {name} do, and what should a caller watch out for?",
    "Question: Summarize how {name} behaves, including its edge cases.",
    "Question: Which of these documents describe {name}, and do they agree?",
]
CODE_SYSTEM_PROMPT = "You are an expert Python developer. Be precise and concise."
CODE_INSTRUCTIONS = [
    "Explain what this code does, function by function.",
    "Write pytest unit tests for the public functions above.",
    "Add type hints to the functions above and point out any bugs you notice.",
    "Refactor the code above for readability without changing its behaviour.",
    "Review this code as a senior engineer: list the three most important problems.",
]
COPY_KINDS = ["launch blog post", "product newsletter", "landing page", "series of social media posts",
              "press release", "short video script"]
COPY_AUDIENCES = ["data scientists", "students learning to code", "DevOps engineers", "startup founders",
                  "teachers", "hobbyist programmers"]
COPY_TONES = ["enthusiastic", "professional", "playful", "calm and reassuring", "bold"]


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request.

    Attributes:
        messages: the chat form (``role``/``content`` dicts) sent to /v1/chat/completions.
        prompt: the same text as one string (contents joined by a blank line) sent to /v1/completions.
        prompt_len: tokens of ``prompt`` under the workload's tokenizer.
        max_tokens: tokens to generate (sent with ``ignore_eos``, so the output has exactly this length).
        extra: more fields of the request body, merged last (e.g. ``documents``, ``cache``, ``ignore_eos``).
    """

    messages: list[dict[str, str]]
    prompt: str
    prompt_len: int
    max_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkloadSpec:
    """A scenario: inclusive token ranges of prompts and outputs and the function that writes one prompt."""

    name: str
    description: str
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    build: Callable[[Corpus, random.Random, int], list[dict[str, str]]]


def _fit(corpus: Corpus, make: Callable[[int], list[dict[str, str]]], target: int,
         bounds: tuple[int, int]) -> tuple[list[dict[str, str]], str, int]:
    """Messages whose joined text has ``target`` tokens, give or take a few and within ``bounds``.

    ``make(n)`` returns messages whose variable part has ``n`` tokens; ``n`` is corrected from the measured length
    a few times (re-tokenizing a cut text can merge or split tokens at the seams).

    Raises:
        RuntimeError: no length within ``bounds`` was reached (the corpus text is too short).
    """
    n = target
    for _ in range(8):
        messages = make(max(1, n))
        prompt = "\n\n".join(m["content"] for m in messages)
        length = corpus.count(prompt)
        if bounds[0] <= length <= bounds[1] and abs(length - target) <= 8:
            return messages, prompt, length
        n += target - length
    if bounds[0] <= length <= bounds[1]:
        return messages, prompt, length
    raise RuntimeError(f"could not write a prompt of {target} tokens within {bounds} (got {length})")


def _customer_service(corpus: Corpus, rng: random.Random, target: int) -> list[dict[str, str]]:
    entries = rng.sample(corpus.passages, 6)
    faq = "\n\n".join(f"Q: What is {p.source}?\nA: {p.text}" for p in entries)
    question = rng.choice(SUPPORT_QUESTIONS).format(name=entries[0].source)
    fixed = corpus.count(SUPPORT_SYSTEM_PROMPT) + corpus.count(question) + 12

    def make(n: int) -> list[dict[str, str]]:
        context = corpus.head(faq, n - fixed)
        return [{"role": "system", "content": SUPPORT_SYSTEM_PROMPT},
                {"role": "user", "content": f"FAQ:\n{context}\n\nCustomer: {question}"}]
    return _fit(corpus, make, target, (target - 8, target + 8))[0]


def _knowledge_qa(corpus: Corpus, rng: random.Random, target: int) -> list[dict[str, str]]:
    index = rng.randrange(len(corpus.passages))
    docs: list[tuple[str, str]] = []
    while sum(len(text) for _, text in docs) < 6 * target:  # >= 6 characters per token: more than enough text
        index = (index + rng.randint(1, 7)) % len(corpus.passages)
        p = corpus.passages[index]
        docs.append((p.source, p.text))
        if rng.random() < 0.3:  # retrieval returns near-duplicates: a mirror copy with its first sentence dropped
            first_stop = p.text.find(". ")  # (placed next to or just before the original)
            mirror = (f"{p.source} (mirror)", p.text[first_stop + 2:] if first_stop > 0 else p.text.upper())
            docs.insert(len(docs) - rng.randint(0, min(2, len(docs) - 1)), mirror)
    body = "\n\n".join(f"Document {i + 1} [source: {src}]\n{text}" for i, (src, text) in enumerate(docs))
    question = rng.choice(QA_QUESTIONS).format(name=docs[0][0])
    fixed = corpus.count(QA_INSTRUCTION) + corpus.count(question) + 8

    def make(n: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{QA_INSTRUCTION}\n\n{corpus.head(body, n - fixed)}\n\n{question}"}]
    return _fit(corpus, make, target, (target - 8, target + 8))[0]


def _code_assistant(corpus: Corpus, rng: random.Random, target: int) -> list[dict[str, str]]:
    index = rng.randrange(len(corpus.code_files))
    name, source = corpus.code_files[index]
    lines = source.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith(("def ", "class "))] or [0]
    code = "".join(lines[rng.choice(starts[: max(1, len(starts) // 2)]):])
    following = index
    while len(code) < 8 * target:  # a short file continues with the next ones
        following = (following + 1) % len(corpus.code_files)
        extra_name, extra = corpus.code_files[following]
        code += f"\n\n# ---- {extra_name} ----\n{extra}"
    instruction = rng.choice(CODE_INSTRUCTIONS)
    fixed = corpus.count(CODE_SYSTEM_PROMPT) + corpus.count(instruction) + 24

    def make(n: int) -> list[dict[str, str]]:
        snippet = corpus.head(code, n - fixed)
        return [{"role": "system", "content": CODE_SYSTEM_PROMPT},
                {"role": "user", "content": f"Here is part of {name}:\n```python\n{snippet}\n```\n{instruction}"}]
    return _fit(corpus, make, target, (target - 8, target + 8))[0]


def _copywriting(corpus: Corpus, rng: random.Random, target: int) -> list[dict[str, str]]:
    passage = rng.choice(corpus.passages)
    module = passage.source.split(".")[0]
    header = (f"Write a {rng.choice(COPY_KINDS)} for {rng.choice(COPY_AUDIENCES)} about the Python module "
              f"`{module}`. Tone: {rng.choice(COPY_TONES)}. Key facts to work in:")
    fixed = corpus.count(header) + 2

    def make(n: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{header}\n{corpus.head(passage.text * 3, n - fixed)}"}]
    return _fit(corpus, make, target, (target - 4, target + 4))[0]


WORKLOADS: dict[str, WorkloadSpec] = {
    s.name: s for s in (
        WorkloadSpec("customer-service", "shared system prompt + short FAQ + question; TTFT-sensitive",
                     (200, 500), (20, 80), _customer_service),
        WorkloadSpec("knowledge-qa", "retrieved passages (some near-duplicates) + a question",
                     (1500, 3000), (100, 250), _knowledge_qa),
        WorkloadSpec("code-assistant", "code context + an instruction", (1000, 3000), (100, 400), _code_assistant),
        WorkloadSpec("copywriting", "short marketing briefs, long outputs", (50, 200), (300, 800), _copywriting),
    )
}


def make_workload(name: str, corpus: Corpus, num_prompts: int, seed: int = 0) -> list[BenchRequest]:
    """``num_prompts`` requests of scenario ``name``, the same for the same corpus, tokenizer and ``seed``.

    Raises:
        KeyError: unknown scenario name (the message lists the known ones).
        RuntimeError: a prompt could not be fitted to its length (corpus text too short).
    """
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    spec = WORKLOADS[name]
    rng = random.Random(f"{name}/{seed}")
    out = []
    for _ in range(num_prompts):
        target = rng.randint(*spec.prompt_range)
        max_tokens = rng.randint(*spec.output_range)
        lo, hi = spec.prompt_range
        messages = spec.build(corpus, rng, min(max(target, lo + 8), hi - 8))
        prompt = "\n\n".join(m["content"] for m in messages)
        out.append(BenchRequest(messages, prompt, corpus.count(prompt), max_tokens))
    return out
