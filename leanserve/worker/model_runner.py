"""Turns a scheduled step into tensors, runs the model over the paged KV cache, and samples.

Inputs are built as flat Python lists and copied to tensors once per step: ``input_ids``, ``positions``,
``slot_mapping`` (``block_table[pos // block_size] * block_size + pos % block_size``), the padded decode block
table and per-chunk prefill metadata. Logits are computed only at the positions that sample.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

from leanserve.core.request import Request
from leanserve.core.scheduler import ScheduledRequest, SchedulerOutput
from leanserve.kernels import native_ops
from leanserve.model.attention import Q_ROWS_MULTIPLE, AttentionMetadata, DecodeGroup, KVCache, PrefillChunk
from leanserve.model.llama import LlamaModel
from leanserve.model.prefill_attention import PrefillAttentionKernel, prefill_attention_kernel
from leanserve.quantization import check_kv_cache_dtype
from leanserve.quantization.kv_cache import Int8KVCache, zeroed
from leanserve.quantization.prefill_gemm import prefill_gemm_engine
from leanserve.sampling_params import SamplingParams
from leanserve.structured.grammar import GrammarState, bitmask_words
from leanserve.worker.prompt_logprobs import PromptLogprobsChunk, compute_prompt_logprobs, prompt_rows
from leanserve.worker.rejection_sampler import accept_one_hot
from leanserve.worker.sampler import Sampler, SamplingState, TokenLogprobs

import torch

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    """Tokens sampled in one step, by request id: one token, or for a request that verified drafts the accepted
    drafts and the token after them; logprobs (when asked) one entry per token; prompt_logprobs (when asked) the
    prompt tokens this step's chunk scored."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)


def allocate_kv_cache(model: LlamaModel, num_blocks: int | list[int], block_size: int, dtype: torch.dtype | None = None,
                      kv_cache_dtype: str = "auto") -> list[tuple[KVCache, KVCache]]:
    """Zeroed K and V caches for every layer, each [num_blocks, block_size, kv_heads, head_dim]: float tensors of
    ``dtype`` (default the model's; float16 when ``kv_cache_dtype == "float16"``), or :class:`Int8KVCache` when
    ``kv_cache_dtype == "int8"``. ``num_blocks`` may be a list, one count per layer (sliding-window layers with
    their own smaller pool).

    Zeroing matters: padding slots are read (then masked), and masked garbage NaNs would poison the output.

    Raises:
        UnsupportedQuantizationError: unknown ``kv_cache_dtype``.
    """
    check_kv_cache_dtype(kv_cache_dtype)
    cfg = model.config
    counts = [num_blocks] * cfg.num_layers if isinstance(num_blocks, int) else list(num_blocks)
    if kv_cache_dtype == "int8":
        return [(Int8KVCache.zeros(n, block_size, cfg.num_kv_heads, cfg.head_dim, device=model.device),
                 Int8KVCache.zeros(n, block_size, cfg.num_kv_heads, cfg.head_dim, device=model.device))
                for n in counts]
    dtype = torch.float16 if kv_cache_dtype == "float16" else dtype or model.dtype
    return [(zeroed((n, block_size, cfg.num_kv_heads, cfg.head_dim), dtype, model.device),
             zeroed((n, block_size, cfg.num_kv_heads, cfg.head_dim), dtype, model.device))
            for n in counts]


def decode_groups(seq_lens: list[int], block_size: int, slack: float = 1.25) -> list[list[int]]:
    """Split decodes, already sorted by length, into runs whose padded length stays within ``slack`` x the
    shortest member's (plus one block), so the padded attention reads little more than the real KV.

    Args:
        seq_lens: tokens in each sequence (ascending). block_size: tokens per block.

    Returns:
        Lists of consecutive indices into ``seq_lens``.
    """
    groups: list[list[int]] = []
    first_blocks = 0
    for i, n in enumerate(seq_lens):
        blocks = -(-n // block_size)
        if groups and blocks <= first_blocks * slack + 1:
            groups[-1].append(i)
        else:
            groups.append([i])
            first_blocks = blocks
    return groups


class ModelRunner:
    """Executes scheduled steps on one device.

    Args:
        model: the decoder.
        kv_caches: per-layer caches from :func:`allocate_kv_cache`.
        block_size: tokens per KV block.
        sampler: the batched sampler (None: a runner that only builds inputs, as the draft model's).
        seed: seeds the generators of requests that carry no seed of their own.
        use_native_kernels: use the compiled paged decode attention where it applies (see leanserve.kernels), and
            the prefill attention kernel for an fp32 cache (leanserve.model.prefill_attention).
        prefill_gemm: the resolved ``--prefill-gemm`` mode; ``bf16`` gives the prefill attention its bf16 path.

    With ``model.batch_invariant``, each decode is attended on its own (the native kernel does so already; the torch
    path then makes groups of one, no padding), so no sequence's arithmetic depends on its neighbours.
    """

    def __init__(self, model: LlamaModel, kv_caches: list[tuple[KVCache, KVCache]], block_size: int,
                 sampler: Sampler | None, seed: int = 0, use_native_kernels: bool = True,
                 prefill_gemm: str = "lane") -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.device = model.device
        self._rng = random.Random(seed)
        self.generators: dict[str, torch.Generator] = {}
        # structured outputs: request id -> its grammar's matcher (the engine adds and drops them: a finished id may
        # be reused by a new request before this runner sees finished_req_ids)
        self.grammars: dict[str, GrammarState] = {}
        self.decode_kernel = None  # native paged decode attention, used for fp32 / fp16 caches on CPU (fp32 model)
        self.prefill_kernel: PrefillAttentionKernel | None = None  # native prefill attention (fp32/fp16 cache, CPU)
        self.local_block_map: torch.Tensor | None = None  # AttentionMetadata.local_block_map, set by the engine
        k_cache = kv_caches[0][0] if kv_caches else None
        if use_native_kernels and isinstance(k_cache, torch.Tensor) and k_cache.device.type == "cpu" \
                and model.dtype == torch.float32 and k_cache.dtype in (torch.float32, torch.float16):
            ext = native_ops()
            self.decode_kernel = ext.paged_decode_attention if ext is not None else None
            # native prefill attention; fp32 or bf16 dots as --prefill-gemm, on the bf16 GEMM's engine (AMX or not)
            self.prefill_kernel = prefill_attention_kernel(ext, k_cache.shape[3], block_size, prefill_gemm,
                                                           prefill_gemm_engine(model))

    def _generator(self, s: ScheduledRequest) -> torch.Generator | None:
        req = s.request
        if req.sampling_params.is_greedy:
            return None
        g = self.generators.get(req.request_id)
        if g is None:
            seed = req.sampling_params.seed
            g = torch.Generator().manual_seed(seed if seed is not None else self._rng.getrandbits(63))
            self.generators[req.request_id] = g
        return g

    def _tensor(self, data: list[int]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.int64, device=self.device)

    def build_inputs(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor,
                                                                      AttentionMetadata, list[int]]:
        """Flatten ``scheduled`` (decodes first, then prefill chunks, as ordered by the caller).

        Returns:
            (input_ids [T] int64, positions [T] int64, attention metadata, logits indices [N]: the flattened index
            of the last token of each request that samples, in ``scheduled`` order).
        """
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logits_idx: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        meta = AttentionMetadata(slot_mapping=torch.empty(0))
        for s in scheduled:
            start, n, spec = s.request.num_computed_tokens, s.num_new_tokens, s.spec_token_ids
            q_start = len(ids)
            ids += s.request.token_at(start, start + n - len(spec)) + spec
            table = s.block_ids
            for p in range(start, start + n):
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            if n - len(spec) == 1:  # a decode; with drafts, each row attends as a plain decode of its position
                if meta.prefills:
                    raise ValueError("decodes must come before prefill chunks")
                for j in range(n):
                    decode_tables.append(table)
                    decode_lens.append(start + 1 + j)
            else:
                chunk = PrefillChunk(q_start, n, start, self._tensor(table))
                prompt = s.request.num_prompt_tokens
                if start + n > prompt:  # generated tokens recomputed after a preemption
                    meta.recomputed_rows.append((q_start + max(0, prompt - start), q_start + n))
                if start and self.prefill_kernel is None:  # the kernel masks by position itself
                    rows = -(-n // Q_ROWS_MULTIPLE) * Q_ROWS_MULTIPLE  # attention pads the queries to this
                    q_pos = torch.arange(start, start + rows, device=self.device)
                    k_pos = torch.arange(start + n, device=self.device)
                    chunk.mask = k_pos[None, :] <= q_pos[:, None]  # [rows, start + n]; padding rows see all
                meta.prefills.append(chunk)
            if s.samples:
                logits_idx.extend(range(len(ids) - 1 - len(spec), len(ids)))
        meta.decode_kernel = self.decode_kernel
        meta.prefill_kernel = self.prefill_kernel
        meta.local_block_map = self.local_block_map
        if self.decode_kernel:
            groups = [list(range(len(decode_lens)))]
        elif self.model.batch_invariant:
            groups = [[i] for i in range(len(decode_lens))]
        else:
            groups = decode_groups(decode_lens, bs)
        start = 0
        for group in groups:
            if not group:
                continue
            tables = [decode_tables[i] for i in group]
            width = max(len(t) for t in tables)
            lens = self._tensor([decode_lens[i] for i in group])
            mask = None
            if self.decode_kernel is None:
                k_pos = torch.arange(width * bs, device=self.device)
                mask = (k_pos[None, :] < lens[:, None]).view(len(group), 1, 1, -1)
            table = self._tensor([t + [0] * (width - len(t)) for t in tables])
            meta.decode_groups.append(DecodeGroup(start, len(group), table, lens, mask))
            start += len(group)
        meta.slot_mapping = self._tensor(slots)
        return self._tensor(ids), self._tensor(pos), meta, logits_idx

    @torch.inference_mode()
    def measure_decode_cost(self, rows: list[int], repeats: int = 5) -> dict[int, float]:
        """Seconds of a decode step of each number of ``rows`` (forward + logits of every row), the fastest of
        ``repeats`` after one warm-up (other load on the machine only adds time): the cost model of speculative
        decoding's policy.

        Every row is a one-token sequence in block 0 (its K/V written to slot 0): block 0 must hold nothing yet,
        as at engine start (a later owner overwrites the slot before reading it).
        """
        params = SamplingParams(max_tokens=1)
        times: dict[int, float] = {}
        for n in rows:
            fake = [ScheduledRequest(Request(f"cost-{i}", [0], params, 1), 1, [0]) for i in range(n)]
            input_ids, positions, meta, logits_idx = self.build_inputs(fake)
            idx = self._tensor(logits_idx)
            samples = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)
                self.model.compute_logits(hidden[idx])
                samples.append(time.perf_counter() - t0)
            times[n] = min(samples[1:])
        return times

    def _prompt_logprobs(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor,
                         result: ModelRunnerOutput) -> None:
        """Score the prompt tokens that the chunks of requests asking for prompt logprobs cover (rows of ``hidden``
        in ``scheduled`` order)."""
        row = 0
        for s in scheduled:
            req, first = s.request, row
            row += s.num_new_tokens
            num_top = req.sampling_params.prompt_logprobs
            if num_top is None:
                continue
            rows = prompt_rows(req.num_computed_tokens, s.num_new_tokens - len(s.spec_token_ids),
                               req.num_prompt_tokens)
            if rows:
                q = first - req.num_computed_tokens  # flat row of position 0
                entries = compute_prompt_logprobs(self.model, hidden[q + rows.start:q + rows.stop], rows.start,
                                                  req.prompt_token_ids[rows.start + 1:rows.stop + 1], num_top)
                result.prompt_logprobs[req.request_id] = PromptLogprobsChunk(rows.start + 1, entries)

    def _grammar_bitmask(self, sampling: list[ScheduledRequest], num_rows: int, vocab: int
                         ) -> tuple[torch.Tensor, list[int]] | None:
        """Structured outputs: the step's token bitmask (all allowed) with the rows of grammar requests filled,
        and those rows; None when no request of the step has a grammar. A request with drafts gets one row per
        draft the grammar accepts, each from the state after the drafts before it (masked verification)."""
        if not self.grammars:
            return None
        bitmask, rows, row = None, [], 0
        for s in sampling:
            grammar = self.grammars.get(s.request.request_id)
            if grammar is not None:
                if bitmask is None:
                    bitmask = torch.full((num_rows, bitmask_words(vocab)), -1, dtype=torch.int32)
                n = grammar.fill_rows(bitmask, row, s.spec_token_ids)
                rows.extend(range(row, row + n))
            row += len(s.spec_token_ids) + 1
        return (bitmask, rows) if rows else None

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: forward over all scheduled tokens, then sample where a request reached its end."""
        for rid in out.finished_req_ids:
            self.generators.pop(rid, None)
        result = ModelRunnerOutput()
        if not out.scheduled:
            return result
        # decodes first, shortest context first (for length groups), then prefill chunks
        scheduled = sorted(out.scheduled, key=lambda s: (s.num_new_tokens - len(s.spec_token_ids) != 1,
                                                         s.request.num_computed_tokens))
        input_ids, positions, meta, logits_idx = self.build_inputs(scheduled)
        hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)
        self._prompt_logprobs(scheduled, hidden, result)
        sampling = [s for s in scheduled if s.samples]
        if not sampling:
            return result
        logits = self.model.compute_logits(hidden[self._tensor(logits_idx)])  # [rows, vocab] float32
        # one row per position that samples: a draft's row sees the drafts before it as generated tokens
        states, saved = [], {}
        for s in sampling:
            req, g = s.request, self._generator(s)
            if s.spec_token_ids and g is not None:
                saved[req.request_id] = g.get_state()
            for j in range(len(s.spec_token_ids) + 1):
                outputs = req.output_token_ids + s.spec_token_ids[:j] if j else req.output_token_ids
                states.append(SamplingState(req.sampling_params, req.prompt_token_ids, outputs, g))
        sampler_out = self.sampler(logits, states, self._grammar_bitmask(sampling, len(states), logits.shape[1]))
        row = 0
        for s in sampling:
            rid, k = s.request.request_id, len(s.spec_token_ids)
            tokens = sampler_out.token_ids[row:row + k + 1]
            lps = sampler_out.logprobs[row:row + k + 1]
            row += k + 1
            if k:
                a = accept_one_hot(tokens, s.spec_token_ids)
                tokens, lps = tokens[:a + 1], lps[:a + 1]
                if rid in saved:  # rewind the RNG to the uniforms of the kept rows only (one per row)
                    g = self.generators[rid]
                    g.set_state(saved[rid])
                    for _ in range(a + 1):
                        torch.rand((), dtype=torch.float64, generator=g)
            result.sampled[rid] = tokens
            grammar = self.grammars.get(rid)
            if grammar is not None and not grammar.accept(tokens):
                logger.error("request %s: its grammar refused the sampled tokens %s", rid, tokens)
            if lps[0] is not None:
                result.logprobs[rid] = lps
        return result
