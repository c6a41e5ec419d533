"""Turns per-step token deltas into :class:`RequestOutput` objects: detokenizes, applies stop strings,
collects logprobs and timings, and groups the choices of an ``n > 1`` request."""

from __future__ import annotations

from dataclasses import dataclass, field

from leanserve.core.request import Request, RequestStatus
from leanserve.engine.detokenizer import IncrementalDetokenizer
from leanserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from leanserve.worker.prompt_logprobs import PromptLogprobsChunk
from leanserve.worker.sampler import TokenLogprobs


@dataclass
class ChoiceState:
    """Output-side state of one choice (one scheduler :class:`Request`)."""

    index: int
    detokenizer: IncrementalDetokenizer
    output: CompletionOutput


@dataclass
class ParentState:
    """A user request: its prompt and its ``n`` choices."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    choices: dict[str, ChoiceState] = field(default_factory=dict)  # child request id -> state
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # filled chunk by chunk when asked


def metrics_of(req: Request) -> RequestMetrics:
    """Snapshot a request's timestamps."""
    return RequestMetrics(arrival_time=req.arrival_time, first_scheduled_time=req.first_scheduled_time,
                          first_token_time=req.first_token_time, last_token_time=req.last_token_time,
                          finished_time=req.finished_time, num_generation_tokens=len(req.output_token_ids),
                          num_draft_tokens=req.num_draft_tokens, num_accepted_tokens=req.num_accepted_tokens)


class OutputProcessor:
    """Keeps the detokenizers and cumulative outputs of live requests.

    Args:
        tokenizer: the model's tokenizer (``decode``, ``token_bytes``).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add(self, parent: ParentState, children: list[Request]) -> None:
        """Register a request's choices (index = position in ``children``)."""
        if children and children[0].sampling_params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for i, child in enumerate(children):
            params = child.sampling_params
            out = CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None,
                                   cumulative_logprob=0.0 if params.logprobs is not None else None)
            parent.choices[child.request_id] = ChoiceState(i, IncrementalDetokenizer(self.tokenizer, params), out)
            self.child_to_parent[child.request_id] = parent.request_id
        self.parents[parent.request_id] = parent

    def parent_of(self, child_id: str) -> str | None:
        return self.child_to_parent.get(child_id)

    def children_of(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.choices) if parent else []

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    def add_prompt_logprobs(self, request_id: str, chunk: PromptLogprobsChunk) -> None:
        """Append a chunk of the prompt's logprobs (positions already held, as after a preemption's recompute or
        from another choice of the same prompt, are skipped: they are the same)."""
        parent = self.parents[self.child_to_parent[request_id]]
        held = parent.prompt_logprobs
        if held is None or chunk.start + len(chunk.entries) <= len(held):
            return
        if chunk.start > len(held):
            raise ValueError(f"prompt logprobs of {request_id} from position {chunk.start}, {len(held)} held")
        for lp in chunk.entries[len(held) - chunk.start:]:
            entry = {lp.token_id: Logprob(lp.logprob, rank=lp.rank, decoded_token=self._token_text(lp.token_id))}
            for r, (tid, v) in enumerate(lp.top):
                if tid not in entry:
                    entry[tid] = Logprob(v, rank=r + 1, decoded_token=self._token_text(tid))
            held.append(entry)

    def update(self, req: Request, new_token_ids: list[int],
               logprobs: TokenLogprobs | list[TokenLogprobs] | None) -> bool:
        """Apply one step's tokens to a choice (one token, or the accepted run of a speculative step, with one
        logprobs entry per token). Returns True when a stop string ended it (the caller finishes it).

        Tokens go through the detokenizer one at a time, so a stop string completed inside a run ends the choice at
        that token: the tokens after it are dropped here and from ``req.output_token_ids``, as if never generated.
        """
        parent = self.parents[self.child_to_parent[req.request_id]]
        choice = parent.choices[req.request_id]
        out = choice.output
        parent.num_cached_tokens = max(parent.num_cached_tokens, req.num_cached_tokens)
        entries = [] if logprobs is None else [logprobs] if isinstance(logprobs, TokenLogprobs) else logprobs
        detok = choice.detokenizer
        hide_last = req.status is RequestStatus.FINISHED_STOPPED and not req.sampling_params.include_stop_str_in_output
        kept = len(new_token_ids)
        delta = []
        stopped = False
        if not detok.finished:
            for i, token in enumerate(new_token_ids):
                if hide_last and i == len(new_token_ids) - 1:
                    break  # the EOS / stop token that ended the request never shows as text
                delta.append(detok.update([token]))
                if detok.finished:
                    stopped = True
                    kept = i + 1
                    break
        if kept < len(new_token_ids):
            del req.output_token_ids[len(req.output_token_ids) - (len(new_token_ids) - kept):]
        new_token_ids = new_token_ids[:kept]
        out.delta_text = "".join(delta)
        out.delta_token_ids = list(new_token_ids)
        out.token_ids.extend(new_token_ids)
        if out.logprobs is not None:
            for lp in entries[:kept]:
                entry = {tid: Logprob(v, rank=r + 1, decoded_token=self._token_text(tid))
                         for r, (tid, v) in enumerate(lp.top)}
                entry[lp.token_id] = Logprob(lp.logprob, rank=lp.rank, decoded_token=self._token_text(lp.token_id))
                out.logprobs.append(entry)
                out.cumulative_logprob = (out.cumulative_logprob or 0.0) + lp.logprob
        return stopped

    def finish(self, req: Request) -> None:
        """Record the end of a choice: flush held-back text, set finish and stop reasons."""
        parent = self.parents[self.child_to_parent[req.request_id]]
        choice = parent.choices[req.request_id]
        out = choice.output
        detok = choice.detokenizer
        if not detok.finished:
            out.delta_text += detok.flush()  # may itself complete a stop string held behind a split character
        if detok.finished and req.status is not RequestStatus.FINISHED_ABORTED:
            # a stop string ended it, even on the last allowed token (vLLM reports "stop" there too)
            out.stop_reason = detok.stop_reason
            out.finish_reason = "stop"
        else:
            out.stop_reason = req.stop_reason
            out.finish_reason = req.status.finish_reason
        out.text = detok.output_text

    def snapshot(self, req: Request) -> RequestOutput:
        """The current :class:`RequestOutput` of the user request that ``req`` belongs to.

        Only the choice ``req`` carries a delta; the other choices' deltas are cleared. A finished user request
        (all choices finished) is forgotten after this call.
        """
        parent_id = self.child_to_parent[req.request_id]
        parent = self.parents[parent_id]
        outputs = []
        for cid, choice in parent.choices.items():
            out = choice.output
            out.text = choice.detokenizer.output_text
            if cid != req.request_id:
                out.delta_text, out.delta_token_ids = "", []
            else:
                out.metrics = metrics_of(req)
            outputs.append(out)
        finished = all(c.output.finish_reason is not None for c in parent.choices.values())
        plp = parent.prompt_logprobs
        result = RequestOutput(request_id=parent_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
                               outputs=[_copy(o) for o in outputs], finished=finished,
                               num_cached_tokens=parent.num_cached_tokens, metrics=outputs[0].metrics,
                               prompt_logprobs=plp if plp and len(plp) == len(parent.prompt_token_ids) else None)
        for out in outputs:  # a delta is reported once
            out.delta_text, out.delta_token_ids = "", []
        if finished:
            for cid in parent.choices:
                self.child_to_parent.pop(cid, None)
            del self.parents[parent_id]
        return result


def _copy(o: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(index=o.index, text=o.text, token_ids=list(o.token_ids), finish_reason=o.finish_reason,
                            stop_reason=o.stop_reason, logprobs=None if o.logprobs is None else list(o.logprobs),
                            cumulative_logprob=o.cumulative_logprob, delta_text=o.delta_text,
                            delta_token_ids=list(o.delta_token_ids), metrics=o.metrics)
