"""The engine: requests in, one scheduled step at a time, outputs streamed out.

    engine.add_request("r1", "def f(x):", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():        # one forward pass over the whole running batch
            print(out.request_id, out.outputs[0].text)

`step()` = scheduler (who runs, how many tokens, who is preempted) -> model runner (one flat
forward, sampling: the one seam between the engine and whatever runs the model) -> bookkeeping
(append tokens, stop checks, free finished requests' blocks, cache newly full blocks); with
async_scheduling the next decode step is queued before this one is read (engine/overlap.py).
Requests can be added or aborted between any two steps: that is continuous batching. A step
that raises fails only the requests that fail on their own; the others go on.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from llmopt.config import EngineConfig
from llmopt.engine import stats
from llmopt.engine import kv_offload
from llmopt.engine.kv_transfer import make_connector
from llmopt.engine.kv_budget import HostMemoryRelease, check_kv_pool_fits, kv_blocks_from_budget
from llmopt.engine.overlap import OverlapLoop
from llmopt.engine.request_checks import ProcessedPrompt, check_priority, check_prompt, check_request
from llmopt.engine.scheduler import Scheduler, SchedulerOutput
from llmopt.model.config import ModelConfig
from llmopt.model.loader import generation_eos_ids, load_model, load_tokenizer
from llmopt.model.registry import resolve_model
from llmopt.outputs import RequestOutput
from llmopt.sampling_params import SamplingParams
from llmopt.sequence import Sequence
from llmopt.spec import step as spec_step
from llmopt.spec.proposers import make_proposer
from llmopt.structured.manager import StructuredOutputManager
from llmopt.worker import huge_pages, kv_pools
from llmopt.worker.backends import choose_step_backend
from llmopt.worker.kv_cache import kv_cache_torch_dtype
from llmopt.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_path = resolve_model(config.model)
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({limit}); allowed: 1..{limit}")
        self.max_model_len = config.max_model_len or limit
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.model_config.torch_dtype)
        self.tokenizer = load_tokenizer(resolve_model(config.tokenizer) if config.tokenizer else self.model_path)
        self.detokenizer = None if config.load_format == "dummy" else self.tokenizer  # random weights: ids only
        self.eos_token_ids = set(self.model_config.eos_token_ids) | generation_eos_ids(self.model_path)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        torch.manual_seed(config.seed)
        self.executor = None  # tensor/pipeline parallel: the driver's handle on the worker ranks
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            from llmopt.distributed.executor import start_workers

            self.executor = start_workers(config, self.model_path, self.model_config, self.dtype, self.device)
            self.model = self.executor.model  # the driver's own shard
        else:
            self.model = load_model(self.model_path, self.dtype, self.device, config.quantization,
                                    config.load_format, config.seed)
            huge_pages.move_weights(self.model)  # CPU weights onto 2 MB pages, before anything holds one
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)

        cfg, self.block_size = self.model_config, config.block_size
        self.proposer = make_proposer(config.speculative_config, self.model, self.model_config, self.model_path,
                                      self.dtype, self.device)
        # the pool's dtype: the model's, or FP8 (1 byte a number: more blocks in the same budget)
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        ex = self.executor  # with parallel workers, one rank's share of a block: its stage's layers, its KV heads
        self.bytes_per_block = kv_pools.bytes_per_block(cfg, self.block_size, self.kv_cache_dtype,
                                                        *((ex.kv_layers, ex.kv_heads) if ex else ()))
        if self.proposer is not None:  # a draft's KV lives in blocks of the same tables
            self.bytes_per_block += self.proposer.bytes_per_block(self.block_size)
        try:
            self.num_blocks = config.num_kv_blocks or kv_blocks_from_budget(
                config, self.model, self.device, self.max_model_len, self.bytes_per_block)
            check_kv_pool_fits(self.num_blocks, self.bytes_per_block, self.device)
        except BaseException:
            self.close()
            raise
        offloading = config.kv_offloading_size is not None or config.kv_transfer_config is not None
        prefix_cache = kv_offload.prefix_cache_class(config.prefix_cache, offloading)
        self.block_manager = prefix_cache(self.num_blocks, self.block_size, config.enable_prefix_caching)
        if ex is not None:  # every rank allocates its share of the same blocks
            self.kv_cache = ex.init_kv_cache(self.num_blocks)
        else:  # one process (enforce_eager=True: attention in plain torch too, no kernel)
            self.kv_cache = kv_pools.build_kv_pool(cfg, self.num_blocks, self.block_size, self.dtype, self.device,
                                                   config.kv_cache_dtype, kernels=not config.enforce_eager)
        if offloading:  # the tiers below the pool (host memory, disk), a decode engine's received prompts
            self.block_manager.offload = kv_offload.build_offload(self.kv_cache, config, self.device)
        self.kv_connector = make_connector(config, self.block_manager)  # disaggregated prefill / decode
        kv_pools.set_kv_scales(self.kv_cache, config.calculate_kv_scales, self.model, self.tokenizer,
                               self.model_path, self.max_model_len, config.kv_cache_rotation)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_chunked_prefill,
                                   config.scheduling_policy, max_in_flight=config.pipeline_parallel_size)
        self.runner = (ModelRunner if ex is None else ex.make_runner)(
            self.model, self.kv_cache, self.block_size, self.device, self.eos_token_ids)
        self.runner.backend = choose_step_backend(  # chosen once: eager torch, compiled CPU step, CUDA graphs
            self.model, self.kv_cache, self.device, config.enforce_eager, self.executor is not None,
            config.max_num_seqs, -(-self.max_model_len // self.block_size), config.max_num_batched_tokens,
            config.enable_deterministic_inference)
        self.decode_path = self.runner.backend.path
        self.runner.keep_hidden = self.proposer is not None  # an EAGLE head reads every step's hidden states
        self.overlap = (OverlapLoop(self, self._schedule, self._execute, self._process)  # the plain step's phases
                        if config.async_scheduling else None)
        self.requests: dict[str, Sequence] = {}
        self.in_flight: deque[SchedulerOutput] = deque()  # pipelined steps submitted, oldest first
        # structured outputs: grammars compile in worker threads; bitmask, matchers, jump-forward
        self.structured = StructuredOutputManager(self.tokenizer, cfg.vocab_size, self.eos_token_ids,
                                                  self.max_model_len)
        self.trace: list[dict] | None = [] if config.enable_trace else None
        self.step_count = 0
        self.stats = {"num_requests": 0, "num_finished": 0, "num_aborted": 0, "num_failed": 0,
                      "prompt_tokens": 0, "generation_tokens": 0}
        self.num_spec_tokens = (config.speculative_config or {}).get("num_speculative_tokens", 0)
        if self.proposer is not None:
            self.proposer.bind(self.num_blocks, self.block_size, self.kv_cache,
                               compiled=self.decode_path == "compiled", kernels=not config.enforce_eager)
        self.spec_stats = spec_step.new_spec_stats(self.num_spec_tokens)
        # last, so dropped last: `del llm` frees the engine (no cycle), then this returns the pages to the OS
        self._memory_release = HostMemoryRelease()

    def close(self) -> None:
        """Stop the grammar compiler's threads and the worker ranks, if any; close received prompts' files
        and the offload tier's."""
        for part in (getattr(self, "structured", None), getattr(self, "kv_connector", None),
                     getattr(getattr(self, "block_manager", None), "offload", None)):
            if part is not None:
                part.close()
        if self.executor is not None:
            self.executor.close()

    # -- requests ------------------------------------------------------------------------------
    def validate_prompt(self, prompt, index: int | str = 0) -> tuple[str | None, list[int]]:
        """A prompt (text, or {'prompt_token_ids': [...]}) -> (text, token ids); ValueError if bad."""
        return check_prompt(self, prompt, index)

    def validate_request(self, ids: list[int], params: SamplingParams, index: int | str = 0) -> None:
        """ValueError for a request this engine could never run (see request_checks)."""
        check_request(self, ids, params, index)

    def process_inputs(self, prompt, params: SamplingParams | None = None, index: int | str = 0) -> ProcessedPrompt:
        """Check a prompt and its sampling parameters (ValueError naming what is wrong) and tokenize
        it: what `add_request` admits without checking again (LLM.generate checks a whole batch so)."""
        params = params or SamplingParams()
        text, ids = self.validate_prompt(prompt, index)
        self.validate_request(ids, params, index)
        return ProcessedPrompt(text, ids, params)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> Sequence:
        """Admit a request: `prompt` is text, {'prompt_token_ids': [...]}, or what
        `process_inputs` returned (then `params` is already part of it)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        priority = check_priority(priority)
        checked = prompt if isinstance(prompt, ProcessedPrompt) else self.process_inputs(prompt, params, request_id)
        params = checked.params
        gen = (torch.Generator(device=self.device).manual_seed(params.seed) if params.seed is not None
               else None if params.greedy else self.generator)  # a seed: the request's own draws
        seq = Sequence(request_id, checked.text, checked.token_ids, params, gen, arrival_time, priority)
        if self.kv_connector is not None:
            self.kv_connector.receive(seq)  # a decode engine: the prompt's blocks another engine sent
        self.requests[request_id] = seq
        if params.structured_outputs is not None:
            self.structured.add(seq)  # joins the scheduler once its grammar has compiled
        else:
            self.scheduler.add(seq)
        self.stats["num_requests"] += 1
        self.stats["prompt_tokens"] += len(checked.token_ids)
        return seq

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            seq = self.requests.get(rid)
            if seq is None or seq.is_finished:
                continue
            self.remove_request(seq)
            seq.finish("abort", None)
            self.stats["num_aborted"] += 1

    def fail_request(self, request_id: str, error: Exception) -> RequestOutput | None:
        """End a request whose step raised: finish_reason "error", its blocks back in the pool,
        the exception on its output (None: no such request in the engine)."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        logger.warning("request %s failed in the engine", request_id, exc_info=error)
        self.remove_request(seq)
        seq.error = error
        seq.finish("error", None)
        seq.finalize_text(self.detokenizer)
        self.stats["num_failed"] += 1
        return seq.to_output()

    def remove_request(self, seq: Sequence) -> None:
        """Out of the engine: off the queues, its blocks freed, the proposer's record of it gone."""
        self.requests.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        self.structured.remove(seq)
        if self.kv_connector is not None:  # a received prompt's file, if its first step has not run
            self.kv_connector.release(seq.request_id)
        seq.clear_drafts()
        if self.proposer is not None:
            self.proposer.forget(seq.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.structured.pending)

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        admitted = self._admit_constrained() if self.structured.pending else []
        if self.runner.max_in_flight > 1:  # pipeline parallelism: micro-batches in flight
            return admitted + self._pipelined_step()
        if self.overlap is not None:  # async_scheduling: step n+1 queued before step n is read
            return admitted + self.overlap.step()
        sched = self._schedule()
        sampled, errors = self._execute(sched.scheduled)
        return admitted + self._process(sched, sampled, errors)

    def _admit_constrained(self) -> list[RequestOutput]:
        """Constrained requests whose grammar has compiled join the scheduler (with the text
        their grammar forces at the start); those whose grammar failed end here."""
        outputs = []
        for seq, error in self.structured.admit_ready(wait=not self.scheduler.has_unfinished()):
            if error is not None:
                outputs.append(self.fail_request(seq.request_id, error))
                continue
            self.stats["generation_tokens"] += len(seq.output_token_ids)  # the forced opening
            if seq.is_finished:  # max_tokens reached by the forced opening alone
                outputs.append(self._finish(seq))
            else:
                self.scheduler.add(seq)
        return [out for out in outputs if out is not None]

    def _finish(self, seq: Sequence) -> RequestOutput:
        seq.kv_transfer_params = self.kv_connector.send(seq) if self.kv_connector is not None else None
        self.remove_request(seq)
        seq.finalize_text(self.detokenizer)
        self.stats["num_finished"] += 1
        return seq.to_output()

    def _pipelined_step(self) -> list[RequestOutput]:
        """Several micro-batches in flight (pipeline parallelism): up to `pp` steps submitted, each from
        requests not already in one; while stage 1 runs micro-batch A, stage 0 runs B. One scheduler
        takes turns (vLLM: one per virtual engine), so the KV pool and the prefix cache stay shared."""
        while len(self.in_flight) < self.runner.max_in_flight:
            sched = self._schedule()
            if not sched.scheduled:
                self.scheduler.finish_step(sched)
                break
            constrained = any(seq.grammar is not None for seq, _ in sched.scheduled)
            self.runner.submit(sched.scheduled, self.block_manager.block_tables,
                               self._grammar_bitmask(sched.scheduled) if constrained else None)
            self.in_flight.append(sched)
        if not self.in_flight:
            return []
        sched, sampled = self.in_flight.popleft(), self.runner.collect().sampled
        # a request aborted while its micro-batch was in flight is already gone from the engine
        sched.scheduled = [(seq, n) for seq, n in sched.scheduled if not seq.is_finished]
        return self._process(sched, sampled, {})

    def _schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        bm.step_allocated, bm.step_freed = [], []
        hits_before = bm.prefix_hits
        if self.proposer is not None:
            try:
                self._propose()
            except Exception:
                # drafts only save forwards: this step decodes plainly instead (a request that
                # breaks sampling itself fails below, in the target's step, on its own)
                logger.warning("speculative proposal failed; decoding without drafts", exc_info=True)
                for seq in self.scheduler.running:
                    seq.clear_drafts()
        sched = self.scheduler.schedule()
        sched.prefix_hits_before = hits_before
        if bm.pending_copies or getattr(bm, "offload", None) is not None:  # a plain step moves no block
            kv_offload.move_blocks(self, sched)  # the radix cache's copies, the offload tier's stores and loads
        now = time.perf_counter()
        for seq, _ in sched.scheduled:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        return sched

    def _process(self, sched: SchedulerOutput, sampled: dict, errors: dict) -> list[RequestOutput]:
        """Bookkeeping after a step's forward, request by request: a failure ends the request;
        else the verified drafts are counted, the tokens appended one by one (so that EOS, stop
        strings and max_tokens end it exactly where plain decoding would), and its blocks freed
        (finished) or cached (newly full: their KV is written, so they become shareable)."""
        if self.scheduler.in_flight:  # pipelined: this step's requests may be scheduled again
            self.scheduler.finish_step(sched)
        before = {seq.request_id: (seq.num_computed_tokens, len(seq.spec_token_ids))
                  for seq, _ in sched.scheduled}
        outputs, finished, spec_results = [], [], {}
        now, bm = time.perf_counter(), self.block_manager
        for seq, n in sched.scheduled:
            if seq.request_id in errors:
                outputs.append(self.fail_request(seq.request_id, errors[seq.request_id]))
                finished.append(seq.request_id)
                continue
            emitted = sampled.get(seq.request_id)
            if seq.spec_token_ids and emitted is not None:
                spec_results[seq.request_id] = spec_step.count_verified(self.spec_stats, seq, n, emitted)
            else:
                seq.num_computed_tokens += n
            if seq.spec_token_ids:
                seq.clear_drafts()
            for token, lp in emitted or []:
                seq.append_token(token, now)
                if lp is not None:
                    seq.record_logprobs(token, *lp)
                self.stats["generation_tokens"] += 1
                if seq.grammar is not None and not self.structured.accept(seq, token):
                    break  # the grammar refused it: this request fails alone
                seq.check_stop(self.eos_token_ids, self.max_model_len, self.tokenizer)
                if seq.is_finished:
                    break
            if emitted and seq.grammar is not None:  # forced text appended, no step
                self.stats["generation_tokens"] += self.structured.jump_forward(seq, now)
            if self.proposer is not None and not seq.is_finished:
                bm.trim(seq.request_id, len(seq))  # blocks that only held rejected drafts
            bm.cache_full_blocks(seq.request_id, seq.token_ids, seq.num_computed_tokens)
            if seq.is_finished:
                self._finish(seq)
                finished.append(seq.request_id)
            if emitted is not None:
                outputs.append(seq.to_output())
        if self.trace is not None:
            self.trace.append(stats.trace_record(self, sched, before, finished, spec_results))
        self.step_count += 1
        return outputs

    def _execute(self, scheduled) -> tuple[dict, dict[str, Exception]]:
        """The step's forward and sampling -> (request_id -> emitted tokens, request_id -> error).

        If the batch raises, each request runs again alone (its KV slots are just written again),
        so that only a request that fails by itself fails. A seeded request retried so may draw
        differently: its generator may have been used before the batch raised."""
        if not scheduled:
            return {}, {}
        batches = [scheduled]
        sampled, errors = {}, {}
        while batches:
            batch = batches.pop()
            try:
                constrained = any(seq.grammar is not None for seq, _ in batch)
                out = self.runner.execute(batch, self.block_manager.block_tables,
                                          self._grammar_bitmask(batch) if constrained else None)
                if self.proposer is not None:  # an EAGLE head keeps the target's features
                    self.proposer.observe(out)
                sampled.update(out.sampled)
            except Exception as e:
                if len(batch) == 1:
                    errors[batch[0][0].request_id] = e
                else:  # the batch raised: each request alone
                    batches = [[item] for item in reversed(batch)]
        return sampled, errors

    def _grammar_bitmask(self, scheduled):
        """Structured outputs: what each grammar allows next, over the rows that sample."""
        return self.structured.bitmask(self.runner.sampling_rows(scheduled)[0])

    def _propose(self) -> None:
        """Drafts for every decoding sequence, capped so that a fully accepted run never
        passes max_tokens or max_model_len. Model proposers write KV at the draft positions,
        so those slots are allocated first (vLLM's lookahead slots); where the pool is
        short, that sequence simply decodes plainly this step."""
        seqs, ks = [], []
        for seq in self.scheduler.running:
            k = spec_step.draft_length(seq, self.num_spec_tokens, self.max_model_len)
            if k < 1:
                continue
            if self.proposer.writes_kv and not self.scheduler.allocate_lookahead(seq, self.proposer.lookahead_slots(k)):
                continue
            seqs.append(seq)
            ks.append(k)
        if seqs:
            for seq, (drafts, q) in zip(seqs, self.proposer.propose(seqs, ks, self.block_manager.block_tables)):
                seq.spec_token_ids, seq.spec_draft_probs = drafts, q

    # -- numbers (llmopt/engine/stats.py): blocks used, slots reserved, tokens stored; LLM.get_metrics()
    memory_stats = stats.memory_stats
    get_metrics = stats.metrics
