"""The engine: requests in, one scheduled step at a time, outputs streamed out.

    engine.add_request("r1", "def f(x):", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():        # one forward pass over the whole running batch
            print(out.request_id, out.outputs[0].text)

`step()` = scheduler (who runs, how many tokens, who is preempted) -> model runner (one
flat forward, sampling) -> bookkeeping (append tokens, stop checks, free finished
requests' blocks, cache newly full blocks). Requests can be added or aborted between
any two steps: that is continuous batching, and the server drives it the same way.
A step that raises fails only the requests that fail on their own (finish_reason "error");
the engine and every other request go on.
"""

from __future__ import annotations

import json
import logging
import os
import time
from numbers import Integral
from pathlib import Path

import torch

from llmopt.config import EngineConfig
from llmopt.engine import kv_pools
from llmopt.engine.block_manager import BlockManager
from llmopt.engine.kv_cache import kv_cache_torch_dtype
from llmopt.engine.memory import check_kv_pool_fits, kv_blocks_from_budget
from llmopt.engine.model_runner import ModelRunner
from llmopt.engine.request_checks import check_prompt, check_request
from llmopt.engine.scheduler import Scheduler
from llmopt.engine.sequence import Sequence
from llmopt.layers.moe import moe_step_stats
from llmopt.model.config import ModelConfig
from llmopt.model.loader import load_model, load_tokenizer
from llmopt.model.registry import resolve_model
from llmopt.outputs import RequestOutput
from llmopt.sampling_params import SamplingParams
from llmopt.spec.proposers import make_proposer

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
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path)
        self.eos_token_ids = set(self.model_config.eos_token_ids) | _generation_eos(self.model_path)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        torch.manual_seed(config.seed)
        self.executor = None  # tensor/pipeline parallel: the driver's handle on the worker ranks
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            self.model = self._start_workers()
        else:
            self.model = load_model(self.model_path, self.dtype, self.device, config.quantization)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)

        cfg = self.model_config
        self.block_size = config.block_size
        self.proposer = make_proposer(config.speculative_config, self.model, self.model_config, self.model_path,
                                      self.dtype, self.device)
        # the pool's dtype: the model's, or FP8 (1 byte a number: more blocks in the same budget)
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        self.bytes_per_block = kv_pools.bytes_per_block(cfg, self.block_size, self.kv_cache_dtype, self.executor)
        if self.proposer is not None:  # a draft's KV lives in blocks of the same tables
            self.bytes_per_block += self.proposer.bytes_per_block(self.block_size)
        try:
            self.num_blocks = config.num_kv_blocks or kv_blocks_from_budget(
                config, self.model, self.device, self.max_model_len, self.bytes_per_block)
            check_kv_pool_fits(self.num_blocks, self.bytes_per_block, self.device)
        except BaseException:
            self.close()
            raise
        self.block_manager = BlockManager(self.num_blocks, self.block_size, config.enable_prefix_caching)
        self.kv_cache = kv_pools.build_kv_pool(self)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_chunked_prefill,
                                   config.scheduling_policy)
        self.runner = (ModelRunner if self.executor is None else self.executor.make_runner)(
            self.model, self.kv_cache, self.block_manager, self.device, self.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self.trace: list[dict] | None = [] if config.enable_trace else None
        self.step_count = 0
        self.stats = {"num_requests": 0, "num_finished": 0, "num_aborted": 0, "num_failed": 0,
                      "prompt_tokens": 0, "generation_tokens": 0}
        sc = config.speculative_config
        self.num_spec_tokens = sc["num_speculative_tokens"] if sc else 0
        if self.proposer is not None:
            self.proposer.bind(self.block_manager, self.num_blocks)
        self.spec_stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                           "accepted_per_position": [0] * self.num_spec_tokens}

    def _start_workers(self):
        """Tensor/pipeline parallel: start the worker ranks (or, under torchrun on a rank other
        than 0, serve as one and exit); returns the driver's own shard of the model."""
        from llmopt.distributed import executor
        from llmopt.distributed.parallel_state import launched_by_torchrun

        if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
            executor.serve_torchrun_rank(self.config, self.model_path, self.model_config, self.dtype,
                                         self.device)
            raise SystemExit(0)
        self.executor = executor.MultiprocExecutor(self.config, self.model_path, self.model_config,
                                                   self.dtype, self.device)
        return self.executor.model

    def close(self) -> None:
        """Stop the worker ranks, if any (a one-process engine holds nothing to release)."""
        if self.executor is not None:
            self.executor.close()

    # -- requests ------------------------------------------------------------------------------
    def validate_prompt(self, prompt, index: int | str = 0) -> tuple[str | None, list[int]]:
        """A prompt (text, or {'prompt_token_ids': [...]}) -> (text, token ids); ValueError if bad."""
        return check_prompt(self, prompt, index)

    def validate_request(self, ids: list[int], params: SamplingParams, index: int | str = 0) -> None:
        """ValueError for a request this engine could never run (see request_checks)."""
        check_request(self, ids, params, index)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> Sequence:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(priority, Integral) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        text, ids = self.validate_prompt(prompt, request_id)
        self.validate_request(ids, params, request_id)
        return self._add(request_id, text, ids, params, arrival_time, priority)

    def _add(self, request_id, text, ids, params, arrival_time=None, priority=0) -> Sequence:
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        elif not params.greedy:
            gen = self.generator
        seq = Sequence(request_id, text, ids, params, gen, arrival_time, int(priority))
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self.stats["num_requests"] += 1
        self.stats["prompt_tokens"] += len(ids)
        return seq

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            seq = self.requests.get(rid)
            if seq is None or seq.is_finished:
                continue
            self._drop(seq)
            seq._finish("abort", None)
            self.stats["num_aborted"] += 1

    def fail_request(self, request_id: str, error: Exception) -> RequestOutput | None:
        """End a request whose step raised: finish_reason "error", its blocks back in the pool,
        the exception on its output (None: no such request in the engine)."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        logger.warning("request %s failed in the engine", request_id, exc_info=error)
        self._drop(seq)
        seq.error = error
        seq._finish("error", None)
        seq.finalize_text(self.tokenizer)
        self.stats["num_failed"] += 1
        return seq.to_output()

    def _drop(self, seq: Sequence) -> None:
        """Out of the engine: off the queues, its blocks freed, the proposer's record of it gone."""
        self.requests.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        seq.clear_drafts()
        if self.proposer is not None:
            self.proposer.forget(seq.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.executor is not None and self.executor.pp > 1:  # micro-batches in flight
            from llmopt.distributed.micro_batches import pipelined_step

            return pipelined_step(self)
        sched, hits_before = self._schedule()
        sampled, errors = self._execute(sched.scheduled)
        return self._process(sched, sampled, errors, hits_before)

    def _schedule(self):
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
        now = time.perf_counter()
        for seq, _ in sched.scheduled:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        return sched, hits_before

    def _process(self, sched, sampled, errors, hits_before) -> list[RequestOutput]:
        """Bookkeeping after a step's forward: tokens appended, stops checked, blocks freed or cached."""
        bm = self.block_manager
        now = time.perf_counter()
        before = {seq.request_id: (seq.num_computed_tokens, len(seq.spec_token_ids))
                  for seq, _ in sched.scheduled}
        outputs, finished, spec_results = [], [], {}
        for seq, n in sched.scheduled:
            if seq.request_id in errors:
                outputs.append(self.fail_request(seq.request_id, errors[seq.request_id]))
                finished.append(seq.request_id)
                continue
            drafts = seq.spec_token_ids
            emitted = sampled.get(seq.request_id)
            if drafts and emitted is not None:
                spec_results[seq.request_id] = {"draft_token_ids": list(drafts),
                                                "emitted_token_ids": [t for t, _ in emitted]}
                # k drafts were computed; only the accepted ones (len(emitted) - 1) stay valid
                accepted = len(emitted) - 1
                seq.num_computed_tokens += n - len(drafts) + accepted
                self.spec_stats["num_drafts"] += 1
                self.spec_stats["num_draft_tokens"] += len(drafts)
                self.spec_stats["num_accepted_tokens"] += accepted
                self.spec_stats["accepted_per_position"][:accepted] = [
                    c + 1 for c in self.spec_stats["accepted_per_position"][:accepted]]
            else:
                seq.num_computed_tokens += n
            seq.clear_drafts()
            for token, lp in emitted or []:
                # tokens of an accepted run go in one by one, so that EOS, stop strings and
                # max_tokens end the request exactly where plain decoding would
                seq.append_token(token, now)
                if lp is not None:
                    seq.record_logprobs(token, *lp)
                self.stats["generation_tokens"] += 1
                seq.check_stop(self.eos_token_ids, self.max_model_len, self.tokenizer)
                if seq.is_finished:
                    break
            if self.proposer is not None and not seq.is_finished:
                bm.trim(seq.request_id, len(seq))  # blocks that only held rejected drafts
            # full blocks become shareable once their KV is written
            bm.cache_full_blocks(seq.request_id, seq.token_ids, seq.num_computed_tokens)
            if seq.is_finished:
                self._drop(seq)
                seq.finalize_text(self.tokenizer)
                finished.append(seq.request_id)
                self.stats["num_finished"] += 1
            if emitted is not None:
                outputs.append(seq.to_output())
        if self.trace is not None:
            self._record_trace(sched, before, finished, bm.prefix_hits - hits_before, spec_results)
        self.step_count += 1
        return outputs

    def _execute(self, scheduled) -> tuple[dict, dict[str, Exception]]:
        """The step's forward and sampling -> (request_id -> emitted tokens, request_id -> error).

        If the batch raises, each request runs again alone (its KV slots are just written
        again), so that only a request that fails by itself fails. A seeded request retried
        this way may draw differently from a run without the failure: its generator may have
        been used before the batch raised."""
        def run(items):
            sampled = self.runner.execute(items)
            if self.proposer is not None:
                self.proposer.observe(self.runner)
            return sampled

        if not scheduled:
            return {}, {}
        try:
            return run(scheduled), {}
        except Exception as e:
            if len(scheduled) == 1:
                return {}, {scheduled[0][0].request_id: e}
        sampled, errors = {}, {}
        for item in scheduled:
            try:
                sampled.update(run([item]))
            except Exception as e:
                errors[item[0].request_id] = e
        return sampled, errors

    def _propose(self) -> None:
        """Drafts for every decoding sequence, capped so that a fully accepted run never
        passes max_tokens or max_model_len. Model proposers write KV at the draft positions,
        so those slots are allocated first (vLLM's lookahead slots); where the pool is
        short, that sequence simply decodes plainly this step."""
        seqs, ks = [], []
        for seq in self.scheduler.running:
            if seq.num_computed_tokens != seq.num_tokens - 1:
                continue  # still prefilling
            room = self.max_model_len - len(seq) - 1
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - 1)
            k = min(self.num_spec_tokens, room)
            if k < 1:
                continue
            if self.proposer.writes_kv and not self.block_manager.allocate(seq.request_id, len(seq) + k):
                continue
            seqs.append(seq)
            ks.append(k)
        if seqs:
            for seq, (drafts, q) in zip(seqs, self.proposer.propose(seqs, ks)):
                seq.spec_token_ids, seq.spec_draft_probs = drafts, q

    def _record_trace(self, sched, before, finished, hits, spec_results) -> None:
        bm = self.block_manager
        # decode work: one new token (plus its speculative drafts) after the whole prompt;
        # anything else, a recompute after preemption included, is prefill work
        is_decode = {s.request_id: before[s.request_id][0] >= len(s.prompt_token_ids) and
                     n == 1 + before[s.request_id][1] for s, n in sched.scheduled}
        self.trace.append({
            "step": self.step_count, "time": time.perf_counter(),
            "scheduled": [{"request_id": s.request_id, "num_tokens": n,
                           "context_len": before[s.request_id][0],
                           "num_draft_tokens": before[s.request_id][1],
                           # speculation: the drafts, and what the verification emitted (the
                           # accepted prefix of the drafts, then a replacement or bonus token)
                           **spec_results.get(s.request_id, {}),
                           "kind": "decode" if before[s.request_id][0] >= len(s.prompt_token_ids)
                           else "prefill"} for s, n in sched.scheduled],
            "num_prefill_tokens": sum(n for s, n in sched.scheduled if not is_decode[s.request_id]),
            "num_decode_tokens": sum(n for s, n in sched.scheduled if is_decode[s.request_id]),
            "preempted": [s.request_id for s in sched.preempted],
            "finished": finished,
            "blocks_allocated": list(bm.step_allocated), "blocks_freed": list(bm.step_freed),
            "prefix_hit_tokens": hits,
            "block_tables": {rid: list(t) for rid, t in bm.block_tables.items()},
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
            **self.memory_stats(),
            **moe_step_stats(self.model),  # DeepSeek: tokens per expert, load imbalance
        })

    # -- numbers -------------------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, float]:
        """Blocks used, slots they reserve, and tokens actually stored in them."""
        bm = self.block_manager
        filled: dict[int, int] = {}
        for seq in self.scheduler.running:
            table = bm.block_tables.get(seq.request_id, [])
            for i, b in enumerate(table):
                n = min(self.block_size, max(0, seq.num_computed_tokens - i * self.block_size))
                filled[b] = max(filled.get(b, 0), n)
        used = self.num_blocks - bm.num_free_blocks
        return {"num_blocks": self.num_blocks, "blocks_used": used,
                "blocks_cached": len(bm.cached), "slots_reserved": used * self.block_size,
                "tokens_stored": sum(filled.values()), "kv_cache_usage_perc": bm.usage}

    def get_metrics(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "kv_cache_usage_perc": bm.usage,
            "num_preemptions": float(self.scheduler.num_preemptions),
            "prefix_cache_queries": float(bm.prefix_queries),
            "prefix_cache_hits": float(bm.prefix_hits),
            "spec_decode_num_drafts": float(self.spec_stats["num_drafts"]),
            "spec_decode_num_draft_tokens": float(self.spec_stats["num_draft_tokens"]),
            "spec_decode_num_accepted_tokens": float(self.spec_stats["num_accepted_tokens"]),
            # mean tokens a verification step yields per sequence: 1 + accepted / drafts
            "spec_decode_mean_acceptance_length": 1.0 + self.spec_stats["num_accepted_tokens"] / max(
                1, self.spec_stats["num_drafts"]),
            **{f"spec_decode_num_accepted_tokens_per_pos_{i}": float(c)
               for i, c in enumerate(self.spec_stats["accepted_per_position"])},
            "num_requests_running": float(len(self.scheduler.running)),
            "num_requests_waiting": float(len(self.scheduler.waiting)),
            "num_kv_blocks": float(self.num_blocks),
            **{k: float(v) for k, v in self.stats.items()},
        }


def _generation_eos(path: Path) -> set[int]:
    f = Path(path) / "generation_config.json"  # (a GGUF file has none: its header names EOS)
    if not f.is_file():
        return set()
    try:
        eos = json.loads(f.read_text()).get("eos_token_id")
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from None
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}
