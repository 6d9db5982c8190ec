"""Continuous batching at token granularity.

Each step the scheduler hands the model one flat batch of
(request, num_new_tokens) pairs under a token budget. A request's new tokens
are whatever lags between `num_computed_tokens` and `num_tokens`: a whole or
partial prompt (chunked prefill), one decode token, or a recomputation after
preemption; prefills and decodes share a step with no special case.

    step t:   schedule() -> [(A, 1), (B, 1), (C, 200)]   A, B decode; C prefills
              model runs, samples
              update()   -> B hit EOS: its blocks go back at once
    step t+1: schedule() -> [(A, 1), (C, 1), (D, 57)]    D takes B's place

When blocks run out, the most recently admitted running request is preempted:
its blocks are freed and it goes back to the head of the queue, to be
recomputed later. The oldest request always makes progress, so no deadlock,
and no request ever fails for lack of cache.

With prefix caching on, each full block is registered under its prefix hash
once its KV is computed (prompt and decode blocks alike). Admission takes the
longest run of cached blocks and starts `num_computed_tokens` after them, so
the model runner sees a resumed chunked prefill. The block holding the last
token is never taken from the cache: that token is recomputed so there are
logits to sample from.

    prompt (block_size 4):  [a b c d][e f g h][i j k l]      all three cached
    lookup covers (12 - 1) // 4 = 2 blocks -> num_computed_tokens = 8,
    [i j k l] is recomputed into a fresh block

A waiting request whose next block is still being prefilled by a running one
(the other choices of an n > 1 request, a burst of prompts sharing a system
prompt) waits for it instead of computing it a second time.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from engine.core.adapter_admission import fits_adapters, running_adapters
from engine.core.block_manager import BlockManager
from engine.core.encoder_budget import EncoderBudget
from ipc.pooling_params import needs_every_position
from engine.core.request import Request, RequestStatus, check_stop, is_compiling
from engine.core.scheduler_output import (RequestError, SampledToken, ScheduledRequest, SchedulerOutput, StepOutputs,
                                          emitted_tokens, make_output)
from engine.core.spec_scheduling import SpecStats, add_proposals, record_acceptance, roll_back
from ipc.messages import RequestOutput, SchedulerStats

logger = logging.getLogger(__name__)
CONTRADICTION_MESSAGE = ("no token satisfies the request's constraints together: its grammar (response_format, "
                         "structured_outputs or tools) contradicts allowed_token_ids, bad_words, logit_bias or "
                         "min_tokens, or allows nothing")


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: list[int],
        enable_prefix_caching: bool = False, max_num_encoder_input_tokens: int = 4096,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the tail is preempted first
        self.requests: dict[str, Request] = {}
        self.compiling: dict[str, Request] = {}  # waiting requests whose grammar (or adapter) may not be ready
        self.num_preemptions = 0
        self.enable_prefix_caching = enable_prefix_caching
        self.num_prefix_cache_queries = 0  # tokens looked up at admission, cumulative
        self.num_prefix_cache_hits = 0  # of those, tokens found cached
        self.spec_stats = SpecStats()
        self.encoder_budget = EncoderBudget(max_num_encoder_input_tokens)  # images' tokens encoded per step
        self.max_loras = 0  # distinct LoRA adapters among the running (engine.core.adapter_admission)

    # ---- requests in and out ----

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.grammar is not None or request.adapter_read is not None:
            self.compiling[request.request_id] = request

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        return self._remove(request_ids, RequestStatus.FINISHED_ABORTED)

    def fail_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """End requests that a failed step ran (FINISHED_ERROR), freeing their blocks."""
        return self._remove(request_ids, RequestStatus.FINISHED_ERROR)

    def _remove(self, request_ids: list[str], status: RequestStatus) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            (self.running if request.status == RequestStatus.RUNNING else self.waiting).remove(request)
            self.compiling.pop(request_id, None)
            self._finish(request, status)
            outputs.append(RequestOutput(request_id, [], request.status.finish_reason))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_schedulable_requests(self) -> bool:
        """False when every unfinished request waits for its grammar: nothing to step yet."""
        num_compiling = sum(1 for r in self.compiling.values() if is_compiling(r))
        return bool(self.running) or len(self.waiting) > num_compiling

    def take_grammar_failures(self) -> StepOutputs:
        """Forget the requests whose grammar is ready, and end those whose grammar failed to
        compile or ran out of time, each with the reason, for the client."""
        failed = StepOutputs()
        for request_id, request in list(self.compiling.items()):
            error = request.grammar.check() if request.grammar is not None else None
            if error is None and request.adapter_read is not None:
                error = request.adapter_read.check()  # its adapter's file turned out bad
            if error is not None:
                failed.errors.append(RequestError(request_id, error))
            if error is not None or not is_compiling(request):
                del self.compiling[request_id]
                if error is None:
                    request.adapter_read = None  # read and cached: the request keeps no second hold on the tensors
        if failed.errors:
            failed.outputs = self.fail_requests([e.request_id for e in failed.errors])
        return failed

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_kv_blocks_used=self.block_manager.num_used_blocks,
            num_kv_blocks_free=self.block_manager.num_free_blocks,
            num_preemptions=self.num_preemptions,
            num_prefix_cache_queries=self.num_prefix_cache_queries,
            num_prefix_cache_hits=self.num_prefix_cache_hits,
            num_cached_blocks=self.block_manager.num_cached_blocks,
            spec_decode=self.spec_stats.to_wire() if self.spec_stats.by_method else [],  # [] until a draft
        )

    def reset_prefix_cache(self) -> int:  # every cached block nobody holds dropped (benchmarks); how many
        return self.block_manager.reset_prefix_cache()

    # ---- schedule ----

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.encoder_budget.num_used:  # the last step encoded images
            self.encoder_budget.reset()
        budget = self._schedule_running(output, budget)
        if output.num_preempted == 0:
            self._admit_waiting(output, budget)
        # Proposed tokens last, from what the budget and the pool have left: optional work never
        # preempts a request nor keeps one waiting. Without speculation no request has any.
        if any(s.request.spec_token_ids for s in output.scheduled):
            add_proposals(output, self.block_manager, self.max_num_batched_tokens - output.num_tokens, self.max_model_len)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens, budget)
            if num_new_tokens == 0:  # its next image waits for a step with encoder budget left
                i += 1
            elif self._allocate_or_preempt(request, num_new_tokens, output):
                output.scheduled.append(ScheduledRequest(request, num_new_tokens))
                budget -= num_new_tokens
                i += 1
            # else: `request` itself was preempted and the loop ends, running is now shorter
        return budget

    def _num_new_tokens(self, request: Request, start: int, budget: int) -> int:
        """`request`'s tokens from `start` in this step: up to `budget`, and for a vision-language
        request, cut before an image past the step's encoder budget (engine/core/encoder_budget.py)."""
        if request.images:
            return self.encoder_budget.fit(request, start, budget)
        return min(request.num_tokens - start, budget)

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, output: SchedulerOutput) -> bool:
        """Find blocks for `request`, preempting from the tail of running. False if it preempted itself."""
        num_needed = self.block_manager.num_new_blocks(
            len(request.block_ids), request.num_computed_tokens + num_new_tokens
        )
        while not self.block_manager.can_allocate(num_needed):
            victim = self.running.pop()
            self._preempt(victim)
            output.num_preempted += 1
            if victim is request:
                return False
        request.block_ids.extend(self.block_manager.allocate(num_needed))
        return True

    def _admit_waiting(self, output: SchedulerOutput, budget: int) -> None:
        pending_hashes = self._pending_block_hashes()
        adapters = running_adapters(self.running) if self.max_loras else set()
        num_compiling = 0  # requests passed over while their grammar compiles: they keep their place
        while len(self.waiting) > num_compiling and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[num_compiling]
            if is_compiling(request):
                num_compiling += 1
                continue
            if request.lora_request is not None and not fits_adapters(request, adapters, self.max_loras):
                break  # another adapter than the running ones': it goes first once one drains
            cached_block_ids, next_hash = self._lookup(request)
            if next_hash is not None and next_hash in pending_hashes:
                break  # a running request is computing that block: wait a step and reuse it
            num_cached_tokens = len(cached_block_ids) * self.block_manager.block_size
            num_new_tokens = self._num_new_tokens(request, num_cached_tokens, budget)
            num_needed = self.block_manager.num_new_blocks(len(cached_block_ids), num_cached_tokens + num_new_tokens)
            if num_new_tokens == 0 or not self.block_manager.can_allocate(num_needed, cached_block_ids):
                break
            del self.waiting[num_compiling]
            self._start(request, self.block_manager.allocate(num_needed, cached_block_ids), len(cached_block_ids))
            pending_hashes.update(request.block_hashes[request.num_registered_blocks :])
            self.running.append(request)
            output.scheduled.append(ScheduledRequest(request, num_new_tokens))
            budget -= num_new_tokens

    # ---- prefix caching ----

    def _lookup(self, request: Request) -> tuple[list[int], bytes | None]:
        """The cached blocks `request` can start from, and the hash of the first block
        it would compute itself (None when there is none to share or caching is off)."""
        if (not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None
                or request.pooling_params is not None and needs_every_position(request.pooling_params)):
            return [], None  # prompt log-probs and mean pooling need every prompt position computed
        # Stop before the block holding the last token: it must be recomputed for its logits.
        num_lookup_blocks = (request.num_tokens - 1) // self.block_manager.block_size
        block_hashes = request.extend_block_hashes(num_lookup_blocks, self.block_manager.block_size)
        cached_block_ids = self.block_manager.lookup(block_hashes)
        num_cached = len(cached_block_ids)
        return cached_block_ids, block_hashes[num_cached] if num_cached < num_lookup_blocks else None

    def _start(self, request: Request, block_ids: list[int], num_cached_blocks: int) -> None:
        """Running from now on, holding `block_ids`, the first `num_cached_blocks` of them found cached."""
        request.block_ids = block_ids
        request.num_computed_tokens = num_cached_blocks * self.block_manager.block_size
        request.num_registered_blocks = num_cached_blocks
        request.status = RequestStatus.RUNNING
        if self.enable_prefix_caching:
            if request.num_preemptions == 0:
                request.num_cached_tokens = request.num_computed_tokens
            self.num_prefix_cache_queries += request.num_tokens
            self.num_prefix_cache_hits += request.num_computed_tokens

    def _pending_block_hashes(self) -> set[bytes]:
        """Hashes of blocks that running requests have looked up but not computed yet."""
        if not self.enable_prefix_caching or not self.waiting:
            return set()
        return {h for r in self.running for h in r.block_hashes[r.num_registered_blocks :]}

    def _register_computed_blocks(self, request: Request) -> None:
        """Make the request's newly completed full blocks findable by later requests."""
        block_size = self.block_manager.block_size
        num_full_blocks = request.num_computed_tokens // block_size
        if not self.enable_prefix_caching or num_full_blocks <= request.num_registered_blocks:
            return
        block_hashes = request.extend_block_hashes(num_full_blocks, block_size)
        for i in range(request.num_registered_blocks, num_full_blocks):
            self.block_manager.register(request.block_ids[i], block_hashes[i])
        request.num_registered_blocks = num_full_blocks

    def _preempt(self, request: Request) -> None:
        logger.debug("preempting %s", request.request_id)
        self.block_manager.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- update ----

    def update(self, output: SchedulerOutput, sampled: dict[str, SampledToken]) -> StepOutputs:
        """Advance computed counts, append sampled tokens, retire finished requests at once."""
        results = StepOutputs()
        outputs = results.outputs
        for scheduled in output.scheduled:
            request = scheduled.request
            num_proposed = len(scheduled.spec_token_ids)
            request.num_computed_tokens += scheduled.num_new_tokens - num_proposed
            token = sampled.get(request.request_id)
            if token is None:
                self._register_computed_blocks(request)
                if request.embedding is not None:  # an embedding request's last chunk: pooled, done
                    outputs.append(self._finish_pooled(request))
                continue  # a prefill chunk that did not reach the end of the sequence
            if token.prompt_logprobs is not None:
                request.prompt_logprobs = token.prompt_logprobs
            new_tokens, status = [], None
            for new_token in emitted_tokens(token):  # one, or the accepted proposed tokens and one
                new_tokens.append(new_token)
                request.append_token(new_token.token_id)
                if new_token.logprobs is not None:
                    request.logprobs.append(new_token.logprobs)
                status = check_stop(request, new_token.token_id, self.eos_token_ids, self.max_model_len)
                if status is not None:
                    break  # tokens after a stop are dropped
            num_accepted = 0
            if num_proposed:  # the accepted tokens' KV is computed; the rejected tail's blocks go back
                num_accepted = min(len(token.accepted), len(new_tokens))
                request.num_computed_tokens += num_accepted
                roll_back(self.block_manager, request)
                record_acceptance(request, num_proposed, num_accepted)
                self.spec_stats.record(request.spec_method, num_proposed, num_accepted, len(new_tokens))
            self._register_computed_blocks(request)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
                if status == RequestStatus.FINISHED_ERROR:  # its grammar's mask left no token
                    results.errors.append(RequestError(request.request_id, CONTRADICTION_MESSAGE))
            outputs.append(make_output(request, new_tokens, token.prompt_logprobs, num_proposed, num_accepted))
        return results

    def _finish_pooled(self, request: Request) -> RequestOutput:
        """No decode: the request ends in the step that pooled it, its blocks freed at once."""
        self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        return RequestOutput(request.request_id, [], request.status.finish_reason,
                             num_cached_tokens=request.num_cached_tokens, embedding=request.embedding)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.finish_time = time.time()
        self.block_manager.free(request.block_ids)
        request.block_ids = []
        del self.requests[request.request_id]

