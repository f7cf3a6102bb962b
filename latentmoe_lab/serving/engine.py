"""Engine: requests in, tokens out, one scheduler step at a time (docs/design.md §6.6).

One request from arrival to its last token:

    engine.add_request(prompt, params)     inputs.py checks the prompt and images -> a Sequence, waiting
    engine.step()                          scheduler.py picks the step's tokens: decodes, then prefill chunks
                                           (the sequence gets a KDA slot, a prefix-cache hit, blocks)
        model_runner.py                    packs them into one ForwardBatch; the model reads and writes the
                                           paged pools; logits [S, vocab] at each sequence's last new token
        sampling.py                        a sequence whose chunk reached its last token samples one token
                                           with its own generator
        scheduler.finish_step              counts the tokens in, offers full blocks to the prefix cache,
                                           stops on max_tokens / a stop id / max_model_len, frees the cache
    ... until finished: the RequestOutput carries token_ids (generated only) and metrics.

A bad request (empty, too long, bad sampling params, images that do not match placeholders, a full
queue) raises ValueError from add_request; the engine is untouched. A request that fails inside a step
(its images fail to encode, its logits are not finite) ends with finish_reason "error" and .error set;
the others go on. A step whose forward or sampling raises puts its requests back for recompute, blames
them by bisection (failures.py: isolation groups, then retries of the one request left, then it fails
alone) and raises StepError naming them; the engine stays consistent and steps on (generate() and stream()
do so by themselves). reset() aborts everything, for a caller that no longer trusts it.

With parallel.tensor_parallel_size / expert_parallel_size / pipeline_parallel_size > 1 the forward runs
on pp * tp * ep worker processes (serving/workers/: parallel_runner.py, pipeline stages in pipeline_stage.py),
and with parallel.forward_process on one; a worker that dies or hangs is replaced by a fresh group and every
running request recomputed, so callers see no error; call close() to stop the workers.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from latentmoe_lab.parallel.eplb.load import ExpertLoadRecorder, moe_layers
from latentmoe_lab.parallel.eplb.online import OnlineBalancer
from latentmoe_lab.serving.cache_tiers.spill import block_manager_for, connect_runner, spill_stats
from latentmoe_lab.serving.config import ServiceConfig, serving_layout
from latentmoe_lab.serving.failures import StepError, settle_failed_step
from latentmoe_lab.serving.inputs import prompt_inputs
from latentmoe_lab.serving.invariance import batch_invariant_grid
from latentmoe_lab.serving.logprobs import TokenLogprob
from latentmoe_lab.serving.metrics import MetricsLog, RequestMetrics, StepRecord
from latentmoe_lab.serving.model_runner import ModelRunner
from latentmoe_lab.serving.planner import check_model_fits, plan_cache, with_cache_budget
from latentmoe_lab.serving.sampling import SamplingParams
from latentmoe_lab.serving.scheduler import Scheduler
from latentmoe_lab.serving.sequence import Sequence, Status
from latentmoe_lab.serving.spec.hidden_rows import SlotHiddenRows, slot_copier
from latentmoe_lab.serving.spec.setup import make_drafter
from latentmoe_lab.serving.spec.speculator import Speculator, spec_stats
from latentmoe_lab.serving.step_sampling import sample_step
from latentmoe_lab.serving.workers.parallel_runner import ParallelRunner, WorkerGroupError, worker_threads
from latentmoe_lab.serving.workers.pipeline_stage import plan_stages

MAX_WORKER_RESTARTS_IN_A_ROW = 3  # a parallel step that loses its workers again and again raises


class QueueFullError(ValueError):
    """scheduler.max_batch_size requests are already held (waiting + running)."""


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far (all of them once finished)
    new_token_ids: list[int] = field(default_factory=list)  # generated in the step that made this output
    finished: bool = False
    finish_reason: str | None = None  # "length", "stop", "abort" or "error"
    error: str | None = None
    metrics: RequestMetrics | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of token_ids, with params.logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # of prompt tokens 1.., with params.prompt_logprobs


class Engine:
    def __init__(self, model, service_config: ServiceConfig, device: torch.device | str = "cpu"):
        if not isinstance(service_config, ServiceConfig):
            raise TypeError(f"service_config: expected a ServiceConfig, got {type(service_config).__name__}")
        cfg = with_cache_budget(model.config, service_config, device)  # no memory.cache_bytes: a CPU default
        layout = serving_layout(model.config, cfg.parallel)  # None: the forward runs here; else on workers
        if layout is not None and torch.device(device).type != "cpu":
            raise ValueError(f"device: parallel serving runs its gloo workers on the CPU, got {device}")
        self.config = cfg
        self.model_config, self.tokenizer_dir = model.config, getattr(model, "name_or_path", None)  # text prompts
        check_model_fits(model, cfg)
        drafter = make_drafter(cfg.speculative, model)  # before anything is allocated
        self.speculator = None if drafter is None else Speculator(drafter, cfg.speculative)  # spec/speculator.py
        # with an MTP head the forward returns every new token's hidden state (the drafter's input, each slot's row)
        return_hidden = model.config.mtp_depth > 0
        # a worker rank's pools hold its pipeline stage's layers with its local KDA heads: plan each stage's
        # share (one block count for all); self.plan is stage 0's
        self.stages = None if layout is None else plan_stages(self.model_config, cfg, layout)
        self.plan = plan_cache(self.model_config, cfg) if layout is None else self.stages[0].plan
        # with a memory.prefix_cache spill (its rows read and written through the runner, connected below)
        self.block_manager = block_manager_for(model, cfg, self.plan)
        self.log = MetricsLog(cfg.scheduler.max_log_records)
        self._sequences: dict[int, Sequence] = {}  # unfinished requests by id (sequence())
        # prefill/decode disaggregation (transport/transfer.py): requests exported and not yet released, by id,
        # with the BlockManager their blocks came from; and what a transferred cache must match, once computed
        self.held: dict[int, tuple[Sequence, object]] = {}
        self.cache_identity = None
        self._next_id = 0
        self._steps = 0
        self._tokens = {"prefill": 0, "decode": 0}
        # last: a parallel runner starts worker processes, which nothing after it may leave behind
        grid = batch_invariant_grid(model, cfg, layout is None, device)
        # routed tokens per MoE layer and logical expert over the last eplb.window_steps steps (/metrics, EPLB)
        moe = moe_layers(model)
        self.expert_load = ExpertLoadRecorder.for_model(model, cfg.eplb.window_steps) if moe else None
        self.balancer = None if not (cfg.eplb.enabled and moe) else OnlineBalancer(
            len(moe), moe[0].num_experts, layout.ep, cfg.eplb.num_redundant_experts, moe[0].n_group,
            cfg.eplb.rebalance_interval_steps, cfg.eplb.layers_per_step)
        # the runner owns the pools (in this process, or its workers'): everything else reaches them through it
        self.runner = (ModelRunner(model, self.plan, device, cfg.scheduler.batch_invariant, return_hidden)
                       if layout is None
                       else ParallelRunner(model, self.stages, layout, worker_threads(cfg.parallel, layout),
                                           self.balancer, self.expert_load, return_hidden))
        self.slot_hidden = SlotHiddenRows.for_engine(model, self.plan, device)  # spec/hidden_rows.py
        connect_runner(self.block_manager, self.runner, self.slot_hidden)
        self.scheduler = Scheduler(self.block_manager, cfg.memory.max_num_seqs, cfg.scheduler.prefill_chunk_size,
                                   cfg.scheduler.chunked_prefill, slot_copier(self.runner, self.slot_hidden), grid,
                                   spec_tokens=0 if self.speculator is None else self.speculator.k,
                                   forget=None if self.speculator is None else self.speculator.forget)

    # ------------------------------------------------------------- requests
    def add_request(self, prompt, params: SamplingParams | None = None) -> int:
        """Queue one request; returns its id. Raises ValueError / TypeError for this request alone."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        if self.scheduler.num_unfinished >= self.config.scheduler.max_batch_size:
            raise QueueFullError(f"queue full: scheduler.max_batch_size ({self.config.scheduler.max_batch_size}) "
                                 f"requests are already waiting or running")
        ids, images = prompt_inputs(prompt, self.model_config, self.tokenizer_dir)
        limit = self.config.model.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate under model.max_model_len "
                             f"({limit})")
        for name, ids_given in (("stop_token_ids", params.stop_token_ids),
                                ("logit_bias", [t for t, _ in params.logit_bias])):
            if any(t >= self.model_config.vocab_size for t in ids_given):
                raise ValueError(f"{name}: token ids must be < vocab_size ({self.model_config.vocab_size})")
        seq = Sequence(self._next_id, ids, params, images, max_tokens=min(params.max_tokens, limit - len(ids)))
        self._next_id += 1
        self._sequences[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: int) -> RequestOutput:
        seq = self._sequences.get(request_id)
        if seq is None:
            raise ValueError(f"request_id: no unfinished request {request_id}")
        self.scheduler.finish(seq, "abort")
        return self._finished_output(seq, time.monotonic())

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def sequence(self, request_id: int) -> Sequence | None:
        """An unfinished request's Sequence (tokens, slot, blocks), None once it finished or left the engine."""
        return self._sequences.get(request_id)

    # ------------------------------------- prefill/decode disaggregation hooks (serving/transport/transfer.py)
    def detach(self, request_id: int) -> Sequence:
        """Take a running request out of the engine with its blocks and slot still held: the prefill side of
        a transfer keeps them until the decode side acknowledges; the caller then releases them."""
        seq = self._sequences.get(request_id)
        if seq is None or seq.status is not Status.RUNNING:
            raise ValueError(f"request_id: no running request {request_id}")
        self.scheduler.running.remove(seq)
        del self._sequences[request_id]
        return seq

    def adopt(self, make_sequence) -> Sequence:
        """Enter a sequence whose cache the caller already wrote into the pools, as running: the decode side
        of a transfer. make_sequence(request_id) returns it with its slot, blocks and num_computed set."""
        seq = make_sequence(self._next_id)
        self._next_id += 1
        self._sequences[seq.request_id] = seq
        self.scheduler.running.append(seq)
        return seq

    # ----------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; an output for every request that got a token or finished in it."""
        start = time.monotonic()
        batch = self.scheduler.schedule()
        if not batch.entries and self.scheduler.waiting and not self.scheduler.running:
            # cannot happen while the planner guarantees one max_model_len sequence fits: fail loudly, never spin
            raise RuntimeError(f"scheduler: {len(self.scheduler.waiting)} requests wait but none can be admitted "
                               f"(free blocks {self.block_manager.num_free_blocks}, slots used "
                               f"{self.block_manager.slots_used})")
        schedule_time = time.monotonic() - start  # + the ForwardBatch build below; not the vision tower
        outputs = [self._fail(seq, error) for seq, error in self.runner.encode_batch_images(batch)]
        batch.entries = [(seq, n) for seq, n in batch.entries if seq.status is Status.RUNNING]
        for seq, _ in batch.entries:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = start
        sampled: dict[int, list[int]] = {}
        output = None
        if batch.entries:
            try:
                output = self.runner.run(batch)
                if self.expert_load is not None:
                    self.expert_load.record(self.runner.expert_counts())
                schedule_time += self.runner.last_build_time
                sampled = sample_step(batch, output, self.speculator, self.model_config.layer_types,
                                      lambda seq, error: outputs.append(self._fail(seq, error)))
            except WorkerGroupError as error:
                self._restart_workers()
                if error.lost and self.runner.restarts_in_a_row <= MAX_WORKER_RESTARTS_IN_A_ROW:
                    return outputs  # failover: every running sequence is recomputed from the next step on
                raise self._step_failed(batch, error, outputs) from error
            except Exception as error:  # noqa: BLE001 - any failure of the forward or sampling is the step's
                # the layers before the failure already advanced these KDA slots: recompute them from scratch
                for seq, _ in reversed(batch.entries):
                    if seq.status is Status.RUNNING:
                        self.scheduler.preempt(seq)
                raise self._step_failed(batch, error, outputs) from error
        decode = batch.num_decode_tokens  # before finish_step, which makes a prompt finished here look like a decode
        prefill, prefill_chunks = batch.num_tokens - decode, batch.num_prefill_chunks
        self._tokens["prefill"] += prefill
        self._tokens["decode"] += decode
        # a verify step's real tokens: its last token and the accepted drafts (one per emitted token)
        committed = [len(sampled.get(seq.request_id, ())) if seq.verify_slots else n for seq, n in batch.entries]
        if self.slot_hidden is not None:  # each slot's last row, before finish_step snapshots slots
            self.slot_hidden.record(batch.entries, getattr(output, "hidden", None), self.speculator)
        self.scheduler.finish_step(batch, sampled)
        if self.speculator is not None:
            self.speculator.after_step(batch.entries, committed, getattr(output, "hidden", None))
        now = time.monotonic()
        for seq, _ in batch.entries:
            if seq.request_id in sampled:
                new = sampled[seq.request_id]
                seq.token_times += [now] * len(new)
            elif seq.max_tokens == 0 and seq.status is Status.FINISHED and seq.finish_reason == "length":
                new = []  # a prompt-only request, done
            else:
                continue
            out = (self._finished_output(seq, now, new) if seq.status is Status.FINISHED
                   else RequestOutput(seq.request_id, seq.prompt_ids, seq.generated_ids, new))
            out.logprobs = list(seq.logprobs)
            out.prompt_logprobs = None if seq.params.prompt_logprobs is None else list(seq.prompt_logprobs)
            outputs.append(out)
        self._steps += 1
        self.log.steps.append(StepRecord(
            time=now, duration=now - start, schedule_time=schedule_time, prefill_tokens=prefill,
            decode_tokens=decode, running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting), blocks_used=self.block_manager.blocks_used,
            slots_used=self.block_manager.slots_used, preemptions=len(batch.preempted),
            prefix_hit_tokens=self.scheduler.prefix_hit_tokens, prefill_chunks=prefill_chunks))
        return outputs

    def _step_failed(self, batch, error: Exception, outputs: list[RequestOutput]) -> StepError:
        """The step's sequences are back in the waiting queue: settle the blame (failures.py), name them."""
        unfinished = [seq for seq, _ in batch.entries if seq.status is not Status.FINISHED]
        retried, failed = settle_failed_step(self.scheduler, unfinished, error,
                                             self.config.scheduler.max_step_retries)
        outputs += [self._fail(seq, message) for seq, message in failed]
        return StepError([seq.request_id for seq, _ in batch.entries], error, retried, outputs)

    def _restart_workers(self) -> None:
        """After a worker group failed: a fresh group (weights reloaded, empty pools), every running sequence
        back to the head of the waiting queue with prompt + tokens so far, the prefix cache forgotten."""
        for seq in reversed(list(self.scheduler.running)):
            self.scheduler.preempt(seq)
        self._fresh_block_manager()
        self.runner.restart()

    def _fresh_block_manager(self) -> None:
        """Empty bookkeeping of the same pools: no block or slot held, no prefix cached on the device (a
        prefix-cache spill keeps its host and disk tiers: their entries are the same model's)."""
        self.block_manager = self.scheduler.blocks = self.block_manager.emptied()

    def reset(self) -> list[RequestOutput]:
        """Abort every request and forget the prefix cache: an empty engine on the same weights and pools.

        For a caller that no longer trusts the engine after an unexpected failure (the server's worker);
        cheaper than a new Engine, which allocates its pools again. Returns the aborted requests' outputs.
        RuntimeError if the aborts left blocks or slots held, a leak of the bookkeeping: the engine is empty
        and usable all the same (fresh bookkeeping), the error says what was found.
        """
        outputs, problems = [], []
        for request_id in list(self._sequences):
            try:
                outputs.append(self.abort(request_id))
            except RuntimeError as error:  # its holdings are already inconsistent: it goes all the same
                problems.append(f"request {request_id}: {error}")
                del self._sequences[request_id]
        bm = self.block_manager
        if bm.blocks_used or bm.slots_used:
            problems.append(f"{bm.blocks_used} blocks and {bm.slots_used} slots still held after every abort")
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        self._fresh_block_manager()
        if problems:
            raise RuntimeError(f"reset: {'; '.join(problems)} (the bookkeeping was rebuilt empty)")
        return outputs

    def close(self) -> None:
        """Stop the worker processes of a parallel engine (nothing to stop in one process); with a disk
        prefix-cache spill, write the device's and host's cached prefixes there for the next engine."""
        self.block_manager.flush()
        if isinstance(self.runner, ParallelRunner):
            self.runner.close()

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        seq.error = error
        self.scheduler.finish(seq, "error")
        return self._finished_output(seq, time.monotonic())

    def _finished_output(self, seq: Sequence, now: float, new_token_ids: list[int] | None = None) -> RequestOutput:
        seq.finish_time = now
        metrics = RequestMetrics.of(seq)
        self.log.requests.append(metrics)
        del self._sequences[seq.request_id]
        return RequestOutput(seq.request_id, seq.prompt_ids, seq.generated_ids, new_token_ids or [],
                             True, seq.finish_reason, seq.error, metrics)

    # ------------------------------------------------------------ front ends
    def generate(self, prompts: list, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One finished output per prompt, in order. A prompt that is refused gets finish_reason "error".

        Prompts enter as room frees up under scheduler.max_batch_size, so any number may be given.
        """
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts: expected a list of prompts, got {type(prompts).__name__}")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params] * len(prompts)
        results: list[RequestOutput | None] = [None] * len(prompts)
        index_of: dict[int, int] = {}
        pending = deque(range(len(prompts)))
        with tqdm(total=len(prompts), desc="generate", disable=not use_tqdm) as bar:
            while pending or index_of:
                while pending and self.scheduler.num_unfinished < self.config.scheduler.max_batch_size:
                    i = pending.popleft()
                    try:
                        index_of[self.add_request(prompts[i], params_list[i])] = i
                    except (ValueError, TypeError) as error:
                        results[i] = RequestOutput(-1, [], [], finished=True, finish_reason="error", error=str(error))
                        bar.update()
                for out in self.step_through_failures() if self.has_unfinished() else []:
                    if out.finished and out.request_id in index_of:
                        results[index_of.pop(out.request_id)] = out
                        bar.update()
        return results

    def stream(self, prompt, params: SamplingParams | None = None):
        """Yield this request's outputs as its tokens arrive (the engine serves every request meanwhile)."""
        request_id = self.add_request(prompt, params)
        while True:
            for out in self.step_through_failures():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return

    def step_through_failures(self) -> list[RequestOutput]:
        """step(), a failed step giving the outputs it finished: isolation retries the rest (failures.py)."""
        try:
            return self.step()
        except StepError as error:
            return error.outputs

    def stats(self) -> dict:
        bm = self.block_manager
        return {"steps": self._steps, "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "blocks_used": bm.blocks_used, "slots_used": bm.slots_used, "num_blocks": bm.num_blocks,
                "num_slots": bm.num_slots, "cached_blocks": bm.cached_blocks, "snapshots": bm.snapshots_held,
                "preemptions": self.scheduler.num_preemptions, "prefix_hit_tokens": self.scheduler.prefix_hit_tokens,
                **self.scheduler.prefix_hits.stats(),  # per kind: DSA rows found, snapshots, tails recomputed
                "prefill_tokens": self._tokens["prefill"], "decode_tokens": self._tokens["decode"],
                **self.runner.worker_stats(),  # restarts, and per worker rank (none when the forward runs here)
                **spec_stats(self.speculator),  # speculative decoding: drafts verified, accepted, per position
                **self._expert_stats(), **spill_stats(bm),
                **self.runner.offload_stats()}  # memory.offload's host tier

    def _expert_stats(self) -> dict:
        """Balancedness of the recorder's window over the EP ranks (with EPLB's current slots) and the
        routed tokens per [MoE layer][expert] since the engine started."""
        if self.expert_load is None:
            return {"expert_balancedness": 1.0, "expert_tokens": [], "eplb_bytes_moved": 0}
        placement = None if self.balancer is None else self.balancer.slots()
        balance = self.expert_load.balance(self.config.parallel.expert_parallel_size, placement)
        return {"expert_balancedness": balance["balancedness"], "expert_tokens": self.expert_load.total.tolist(),
                "eplb_bytes_moved": self.runner.eplb_bytes_moved}

