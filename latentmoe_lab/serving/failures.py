"""A failed step: who is blamed, by bisection, and who is retried or fails alone (docs/design.md §6.5).

When the forward or the sampling of a step raises, the engine first puts the step's sequences back to
the waiting queue (recompute: prompt + tokens so far; a seeded generator simply goes on), then:

    several sequences in the step   nobody is charged; they are split into two isolation groups that run
                                    in separate steps (scheduler.isolate), so the next failure, if any,
                                    narrows the blame down to one half, then a quarter, ... then one
    one sequence in the step        it is to blame: charged one retry, run alone again; past
                                    scheduler.max_step_retries it fails alone ("engine_step_failed: ...")

and raises StepError naming the step's requests. So a request that breaks every step ("poison") fails
alone after exactly max_step_retries retries, its step-mates are charged nothing and their outputs equal
an unfaulted run; a failure that does not come back (transient) costs one recompute and no retry.
"""
from __future__ import annotations

from latentmoe_lab.serving.scheduler import Scheduler
from latentmoe_lab.serving.sequence import Sequence


class StepError(RuntimeError):
    """Engine.step() failed in the forward or the sampling; the engine is consistent and may step on.

    request_ids  the requests of the failed step
    retried      those charged one retry (at most one: the step ran one request)
    outputs      RequestOutputs that finished during the step: requests failed alone past their retries,
                 and data errors of the step (bad images, non-finite logits); deliver them as step()'s
    cause        the original exception (also __cause__)
    """

    def __init__(self, request_ids: list[int], cause: BaseException, retried: list[int], outputs: list):
        super().__init__(f"step of requests {request_ids} failed: {type(cause).__name__}: {cause}")
        self.request_ids = list(request_ids)
        self.cause = cause
        self.retried = list(retried)
        self.outputs = list(outputs)


def settle_failed_step(scheduler: Scheduler, seqs: list[Sequence], cause: BaseException,
                       max_retries: int) -> tuple[list[int], list[tuple[Sequence, str]]]:
    """Blame for a failed step of `seqs` (already back in the waiting queue, unfinished).

    Returns (ids charged a retry, [(sequence, error) to fail alone]); isolates the rest.
    """
    if len(seqs) != 1:
        scheduler.isolate(seqs)
        return [], []
    seq = seqs[0]
    if seq.step_retries >= max_retries:
        return [], [(seq, f"engine_step_failed: {type(cause).__name__}: {cause} (after {max_retries} retries)")]
    seq.step_retries += 1
    scheduler.isolate(seqs)  # its retry runs alone too, so a failure there is its own again
    return [seq.request_id], []
