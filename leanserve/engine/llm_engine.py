"""The synchronous engine: add requests, call :meth:`LLMEngine.step` until done.

One step = schedule -> run the model -> update the scheduler -> detokenize. The HTTP server drives the same loop
from a background task; :class:`leanserve.LLM` drives it to completion for offline batches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from leanserve.config import EngineConfig
from leanserve.core.kv_cache_manager import KVCacheManager
from leanserve.core.request import Request, RequestStatus
from leanserve.core.scheduler import Scheduler, SchedulerOutput
from leanserve.core.sliding_window import SlidingWindowBlocks, local_pool_size, sliding_window_block_counts
from leanserve.engine.admission import AdmittedRequest, RequestAdmission
from leanserve.engine.output_processor import OutputProcessor, ParentState
from leanserve.errors import InvalidParameterError, ModelLoadError
from leanserve.kernels import native_ops
from leanserve.loader import LoadedModel, load_model
from leanserve.model.attention import PREFILL_MIN_ROWS
from leanserve.model.llama import LlamaModel
from leanserve.model.registry import model_class
from leanserve.outputs import RequestOutput
from leanserve.quantization.kv_cache import kv_bytes_per_token, prefault_pool
from leanserve.quantization.prefill_gemm import configure_prefill_gemm, has_lane_weights, prefill_gemm_engine
from leanserve.sampling_params import SamplingParams
from leanserve.spec_decode.draft_model import DraftModelProposer, shares_kv_cache
from leanserve.spec_decode.ngram import NgramProposer
from leanserve.spec_decode.policy import SpeculationPolicy, StepCostModel
from leanserve.structured.grammar import GrammarState
from leanserve.worker.cpu_threads import set_num_threads, warn_if_openmp_spins
from leanserve.worker.malloc_tuning import tune_malloc
from leanserve.worker.model_runner import ModelRunner, allocate_kv_cache
from leanserve.worker.sampler import Sampler

import torch

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 2 << 30  # bytes
DEFAULT_GPU_KV_FRACTION = 0.8  # of the device memory left free after loading the weights
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # EngineConfig.dtype -> torch


@dataclass
class EngineStats:
    """Counters for metrics and tests (vLLM metric in brackets)."""

    num_running: int  # [vllm:num_requests_running]
    num_waiting: int  # [vllm:num_requests_waiting]
    kv_cache_usage: float  # used blocks / total, in [0, 1] [vllm:kv_cache_usage_perc]
    num_blocks: int
    num_free_blocks: int  # including free blocks that hold cached prefixes
    prefix_cache_queries: int  # prompt tokens looked up [vllm:prefix_cache_queries]
    prefix_cache_hits: int  # prompt tokens found [vllm:prefix_cache_hits]
    num_preemptions: int  # [vllm:num_preemptions]
    spec_num_drafts: int = 0  # verification runs, one per request and step with drafts [vllm:spec_decode_num_drafts]
    spec_num_draft_tokens: int = 0  # drafts verified [vllm:spec_decode_num_draft_tokens]
    spec_num_accepted_tokens: int = 0  # drafts accepted [vllm:spec_decode_num_accepted_tokens]
    # accepted drafts by position in their run [vllm:spec_decode_num_accepted_tokens_per_pos{position}]
    spec_accepted_per_pos: tuple[int, ...] = ()


class LLMEngine:
    """Loads the model, owns the KV cache, scheduler, runner and output processor.

    Args:
        config: engine options.
        loaded: an already loaded model (tests reuse one); default: ``load_model(config.model)``.
        device: torch device; default CUDA when available, else CPU.

    Raises:
        ModelLoadError: when the model cannot be loaded. InvalidParameterError: for bad options.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 device: str | torch.device | None = None) -> None:
        t0 = time.perf_counter()
        self.config = config
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = _DTYPES[config.dtype]
        if config.batch_invariant and (dtype != torch.float32 or self.device.type != "cpu"):
            raise InvalidParameterError("batch_invariant", "batch_invariant needs dtype float32 on CPU")
        loaded = loaded or load_model(config.model, quantization=config.quantization)
        self.model_config = cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_path = loaded.path
        ctx = cfg.max_position_embeddings
        self.max_model_len = config.max_model_len or ctx
        if self.max_model_len > ctx:
            raise InvalidParameterError("max_model_len", f"max_model_len={self.max_model_len} is longer than the "
                                        f"model's context of {ctx} tokens (positions beyond it were never trained)")
        if config.num_threads is not None:
            set_num_threads(config.num_threads)
        self.kv_bytes_per_token = kv_bytes_per_token(cfg, config.kv_cache_dtype, config.dtype)
        spec = config.speculative_config
        draft_loaded, share_draft_kv = None, False
        if spec is not None and spec.method == "draft_model":
            try:
                draft_loaded = load_model(spec.model or loaded.path, quantization=spec.quantization)
            except ModelLoadError as exc:
                raise InvalidParameterError("speculative_config.model", f"the draft model cannot be loaded: {exc}") \
                    from exc
            if draft_loaded.config.vocab_size != cfg.vocab_size:
                raise InvalidParameterError(
                    "speculative_config.model", f"the draft model's vocabulary ({draft_loaded.config.vocab_size} "
                    f"tokens) differs from the target's ({cfg.vocab_size}): drafts must be the target's tokens")
            share_draft_kv = shares_kv_cache(spec.share_kv_cache, loaded.path, cfg, draft_loaded.path,
                                             draft_loaded.config)
            if not share_draft_kv:  # its own KV cache on the target's blocks: each block holds both models' K/V
                self.kv_bytes_per_token += kv_bytes_per_token(draft_loaded.config, config.kv_cache_dtype, "float32")
        if config.kv_cache_memory is not None:  # checked before the weights load, so a bad value fails at once
            self._num_kv_blocks(config.kv_cache_memory)
        self.model = model_class(cfg)(cfg, loaded.weights, dtype=dtype, device=self.device,
                                max_position=max(self.max_model_len, ctx), quantization=config.quantization,
                                group_size=config.quantization_group_size, batch_invariant=config.batch_invariant,
                                native_kernels=config.use_native_kernels)
        gemm = config.prefill_gemm
        if config.batch_invariant and gemm not in ("auto", "lane"):  # every row runs the lane kernel there
            logger.warning("--batch-invariant runs every row through the lane kernel: --prefill-gemm %s is not used",
                           gemm)
        # the mode that runs (resolved)
        self.prefill_gemm = configure_prefill_gemm(self.model, "lane" if config.batch_invariant else gemm)
        # the default on a GPU is a fraction of the memory left free by the weights
        kv_memory = config.kv_cache_memory if config.kv_cache_memory is not None else self._default_kv_memory()
        num_blocks = self._num_kv_blocks(kv_memory)
        # sliding-window layers (Gemma 3): their own pool, bounded by the window (leanserve.core.sliding_window)
        sliding = [cfg.is_sliding(i) for i in range(cfg.num_layers)]
        swa = None
        if any(sliding) and cfg.sliding_window and draft_loaded is None:
            need = local_pool_size(1 << 62, config.block_size, cfg.sliding_window, config.max_num_seqs,
                                   config.max_num_batched_tokens or self.max_model_len)
            num_blocks, num_local = sliding_window_block_counts(
                num_blocks, kv_memory, config.block_size, self.kv_bytes_per_token, sum(sliding), len(sliding), need)
            swa = SlidingWindowBlocks(num_blocks, num_local, config.block_size, cfg.sliding_window)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 min_uncached_tokens=PREFILL_MIN_ROWS, sliding_window=swa)
        if num_blocks * config.block_size < self.max_model_len:
            logger.warning("KV cache holds %d tokens, less than max_model_len=%d",
                           num_blocks * config.block_size, self.max_model_len)
        self.admission = RequestAdmission(self.tokenizer, cfg.vocab_size, self.max_model_len, config.block_size,
                                          num_blocks)
        threshold = config.long_prefill_token_threshold
        if threshold is None:
            threshold = 2048 if self.device.type == "cuda" else 256
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                   policy=config.scheduling_policy, long_prefill_token_threshold=threshold or None,
                                   min_chunk_tokens=PREFILL_MIN_ROWS)
        per_layer = [swa.num_local_blocks if s else num_blocks for s in sliding] if swa else num_blocks
        kv_caches = allocate_kv_cache(self.model, per_layer, config.block_size, kv_cache_dtype=config.kv_cache_dtype)
        if config.kv_cache_prefault:
            self._prefault(kv_caches)
        ext = native_ops() if config.use_native_kernels and self.device.type == "cpu" else None
        sampler = Sampler(self.tokenizer.stop_token_ids, argmax_kernel=getattr(ext, "argmax_rows", None))
        self.runner = ModelRunner(self.model, kv_caches, config.block_size, sampler,
                                  seed=config.seed, use_native_kernels=config.use_native_kernels,
                                  prefill_gemm=self.prefill_gemm)
        if swa is not None:  # read in place each step
            self.runner.local_block_map = torch.frombuffer(swa.local_of, dtype=torch.int64)
        self.processor = OutputProcessor(self.tokenizer)
        self._pending: list[RequestOutput] = []  # outputs of aborted requests, returned by the next step
        self.speculative_config = spec
        self.proposer: NgramProposer | None = None
        self.drafter: DraftModelProposer | None = None
        self.spec_policy: SpeculationPolicy | None = None
        self._spec_counts = [0, 0, 0]  # drafts runs, draft tokens, accepted tokens
        self._spec_per_pos: list[int] = []
        if spec is not None:
            if draft_loaded is None:
                self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
            else:
                draft = LlamaModel(draft_loaded.config, draft_loaded.weights, dtype=torch.float32, device=self.device,
                                   max_position=max(self.max_model_len, draft_loaded.config.max_position_embeddings),
                                   quantization=spec.quantization, group_size=config.quantization_group_size,
                                   native_kernels=config.use_native_kernels)
                if share_draft_kv:
                    draft_caches = kv_caches
                else:
                    draft_caches = allocate_kv_cache(draft, num_blocks, config.block_size,
                                                     kv_cache_dtype=config.kv_cache_dtype)
                    if config.kv_cache_prefault:
                        self._prefault(draft_caches)
                self.drafter = DraftModelProposer(draft, draft_caches, config.block_size, config.use_native_kernels,
                                                  shares_target_cache=share_draft_kv)
            cost = draft_cost = None
            if spec.adaptive:
                # up to 64 rows (~0.5 s at start on 2 CPU cores); more rows are extrapolated linearly
                most = min(64, config.max_num_seqs * (1 + spec.num_speculative_tokens))
                rows = sorted({min(r, most) for r in (1, 2, 4, 8, 16, 32, 64)})
                cost = StepCostModel(self.runner.measure_decode_cost(rows, repeats=3))
                if self.drafter is not None:
                    draft_rows = sorted({min(r, config.max_num_seqs) for r in (1, 2, 4, 8, 16, 32, 64)})
                    draft_cost = StepCostModel(self.drafter.runner.measure_decode_cost(draft_rows, repeats=3))
            self.spec_policy = SpeculationPolicy(cost, draft_cost)
            self._spec_per_pos = [0] * spec.num_speculative_tokens
        if self.device.type == "cpu":  # steps reuse the heap's pages (leanserve/worker/malloc_tuning.py)
            tune_malloc()
            warn_if_openmp_spins()
        self.load_time_s = loaded.load_time_s
        self.init_time_s = time.perf_counter() - t0

    def _num_kv_blocks(self, mem: int) -> int:
        """KV blocks that ``mem`` bytes hold. Raises InvalidParameterError when not even one."""
        num_blocks = int(mem // (self.kv_bytes_per_token * self.config.block_size))
        if num_blocks < 1:
            raise InvalidParameterError("kv_cache_memory", f"kv_cache_memory={mem} bytes holds no block of "
                                        f"{self.config.block_size} tokens ({self.kv_bytes_per_token} bytes per token)")
        return num_blocks

    @staticmethod
    def _prefault(kv_caches: list) -> None:
        """--kv-cache-prefault: the pool resident before the first request (logged with the time it took)."""
        t0 = time.perf_counter()
        nbytes = prefault_pool(kv_caches)
        logger.info("KV pool resident: %.0f MiB in %.2f s (--kv-cache-prefault)", nbytes / 2**20,
                    time.perf_counter() - t0)

    def _default_kv_memory(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * DEFAULT_GPU_KV_FRACTION)
        return DEFAULT_CPU_KV_CACHE_MEMORY

    # ----------------------------------------------------------------------------------------- requests
    def admit(self, prompt: str | list[int], params: SamplingParams | None = None) -> AdmittedRequest:
        """Validate and resolve a request (see :meth:`RequestAdmission.admit`); safe off the engine's thread.

        Raises:
            InvalidParameterError (ContextLengthExceededError among them), KVCapacityError.
        """
        return self.admission.admit(prompt, params or SamplingParams())

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """:meth:`admit` the request, then :meth:`add_admitted` it. Nothing is queued when it raises.

        Raises:
            what :meth:`admit` and :meth:`add_admitted` raise.
        """
        self.add_admitted(request_id, self.admit(prompt, params), arrival_time, priority)

    def add_admitted(self, request_id: str, admitted: AdmittedRequest, arrival_time: float | None = None,
                     priority: int = 0) -> None:
        """Queue an admitted request as ``params.n`` sequences (``request_id`` or ``request_id#i``).

        Args:
            arrival_time: ``time.monotonic()`` of its arrival (default: now); TTFT and queue time count from it.
            priority: lower runs first under the priority policy.
        Raises:
            ValueError: a request with this id is still unfinished.
        """
        if request_id in self.processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = admitted.params
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = replace(params, seed=(params.seed + i) % 2**64)  # stays in the accepted range
            if i and params.prompt_logprobs is not None:  # the first choice computes them for all (same prompt)
                child_params = replace(child_params, prompt_logprobs=None)
            cid = request_id if params.n == 1 else f"{request_id}#{i}"
            child = Request(cid, admitted.prompt_token_ids, child_params, admitted.max_tokens,
                            self.tokenizer.stop_token_ids, arrival_time=arrival, priority=priority)
            if admitted.grammar is not None:
                self.runner.grammars[cid] = GrammarState(admitted.grammar,
                                                          min(self.tokenizer.stop_token_ids, default=None))
            self.scheduler.add_request(child)
            children.append(child)
        parent = ParentState(request_id, admitted.prompt, admitted.prompt_token_ids)
        self.processor.add(parent, children)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests now and free their KV blocks; their final output (finish_reason "abort") comes with
        the next :meth:`step`. Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        for rid in ids:
            for cid in self.processor.children_of(rid):
                req = self.scheduler.finish_request(cid, RequestStatus.FINISHED_ABORTED)
                if req is not None:
                    self._forget_drafts(cid)
                    self.processor.finish(req)
                    self._pending.append(self.processor.snapshot(req))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    # -------------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return a :class:`RequestOutput` for every request that advanced or finished."""
        outputs, self._pending = self._pending, []
        if self.spec_policy is not None:
            self._propose()
        sched_out = self.scheduler.schedule()
        if not sched_out.scheduled:
            return outputs
        if self.drafter is not None:
            self._draft(sched_out)
        runner_out = self.runner.execute_model(sched_out)
        for rid, chunk in runner_out.prompt_logprobs.items():
            self.processor.add_prompt_logprobs(rid, chunk)
        for res in self.scheduler.update_from_output(sched_out, runner_out.sampled):
            req = res.request
            if res.num_draft_tokens:
                self._observe_drafts(req.request_id, res.num_draft_tokens, res.num_accepted_tokens)
            stopped = self.processor.update(req, res.new_token_ids, runner_out.logprobs.get(req.request_id))
            if stopped and not req.is_finished:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            if req.is_finished:
                self.processor.finish(req)
                self._forget_drafts(req.request_id)
            outputs.append(self.processor.snapshot(req))
        return outputs

    # --------------------------------------------------------------------------------- speculative decoding
    def _propose(self) -> None:
        """Give every running decode its drafts for this step (as many as :class:`SpeculationPolicy` finds worth
        verifying; none for a request whose ``params.speculative`` is False)."""
        k = self.speculative_config.num_speculative_tokens
        proposals: dict[str, tuple] = {}
        num_decodes = 0
        for req in self.scheduler.running:
            req.spec_token_ids = []
            if req.num_tokens - req.num_computed_tokens != 1:
                continue  # still prefilling
            num_decodes += 1
            if not req.sampling_params.speculative:
                continue
            if self.drafter is not None:  # lookahead slots now, the draft model's tokens once scheduled
                drafts = [-1] * k
            else:
                drafts = self.proposer.propose(req.request_id, req.prompt_token_ids, req.output_token_ids, k)
            if drafts:
                proposals[req.request_id] = (req, drafts)
        if not proposals:
            return
        if self.drafter is not None:
            k = self.spec_policy.plan_draft_model(num_decodes, list(proposals), k)
            plan = dict.fromkeys(proposals, k)
        else:
            plan = self.spec_policy.plan(num_decodes, {rid: len(d) for rid, (_, d) in proposals.items()})
        for rid, (req, drafts) in proposals.items():
            req.spec_token_ids = drafts[:plan[rid]]

    def _draft(self, sched_out: SchedulerOutput) -> None:
        """Fill the scheduled lookahead slots with the draft model's tokens."""
        todo = [s for s in sched_out.scheduled if s.spec_token_ids]
        if not todo:
            return
        drafts = self.drafter.propose([(s.request, s.block_ids, len(s.spec_token_ids)) for s in todo])
        for s, d in zip(todo, drafts, strict=True):
            s.spec_token_ids[:] = d

    def _observe_drafts(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        self.spec_policy.observe(request_id, num_drafts, num_accepted)
        self._spec_counts[0] += 1
        self._spec_counts[1] += num_drafts
        self._spec_counts[2] += num_accepted
        for i in range(num_accepted):
            self._spec_per_pos[i] += 1

    def _forget_drafts(self, request_id: str) -> None:
        self.runner.grammars.pop(request_id, None)  # a finished request's grammar state too
        if self.spec_policy is not None:
            (self.proposer if self.proposer is not None else self.drafter).reset(request_id)
            self.spec_policy.reset(request_id)

    def describe(self) -> str:
        """One line on what serves: weights, prefill GEMM, prefill attention, KV cache, speculation (logged at
        server start)."""
        c, spec = self.config, self.speculative_config
        kv = c.kv_cache_dtype if c.kv_cache_dtype != "auto" else f"auto ({c.dtype})"
        gemm = ""  # without lane-layout weights --prefill-gemm has nothing to choose: say nothing about it
        if has_lane_weights(self.model):
            engine = prefill_gemm_engine(self.model)
            gemm = f", prefill GEMM {self.prefill_gemm}" + (f" on {engine}" if engine else "")
        kernel = self.runner.prefill_kernel
        attention = f", prefill attention {kernel.describe() if kernel is not None else 'torch SDPA'}"
        line = (f"weights {c.quantization}, dtype {c.dtype}{gemm}{attention}, KV cache {kv} "
                f"({self.kv.num_blocks} blocks of {c.block_size} tokens)")
        if spec is None:
            return line + ", no speculative decoding"
        line += f", speculative decoding {spec.method} (up to {spec.num_speculative_tokens} drafts"
        if self.drafter is not None:
            own = "the target's KV cache" if self.drafter.shares_target_cache else "its own cache"
            line += f", draft {spec.model or 'the target file'} at {spec.quantization}, on {own}"
        return line + ")"

    def get_stats(self) -> EngineStats:
        """Current counters."""
        return EngineStats(num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
                           kv_cache_usage=self.kv.usage, num_blocks=self.kv.num_blocks,
                           num_free_blocks=self.kv.pool.num_free_blocks,
                           prefix_cache_queries=self.kv.prefix_cache_queries,
                           prefix_cache_hits=self.kv.prefix_cache_hits,
                           num_preemptions=self.scheduler.num_preemptions,
                           spec_num_drafts=self._spec_counts[0], spec_num_draft_tokens=self._spec_counts[1],
                           spec_num_accepted_tokens=self._spec_counts[2],
                           spec_accepted_per_pos=tuple(self._spec_per_pos))
