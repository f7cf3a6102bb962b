"""Parallel serving: the engine's steps on pp * tp * ep worker processes (docs/design.md §10).

    Engine (scheduler, sampling, vision tower)        this process: plans blocks and slots, builds each
        |  pipe: the step's ForwardBatch              step's ForwardBatch, samples from the logits
    rank 0 ---- broadcast over gloo ----> ranks 1..n-1   serving/workers/parallel_worker.py: every rank runs its part of
        |                                             the forward over its shard and its own pools;
        |  pipes: every rank's seconds, and from      with pp > 1 (serving/workers/pipeline_stage.py) stage s sends the
        |  the answer rank the logits [S, vocab],     hidden states to stage s + 1, and the answer rank
        |  finite flags and the hidden rows the       is the first rank of the last stage
        |  step asked for (MTP drafts, §12)

serving/config.py's `serving_layout` turns the YAML `parallel` section into a ParallelConfig and refuses what
cannot run, naming the key. `WorkerGroup` owns the processes: forkserver children (a clean single-threaded parent,
never a fork of a threaded server), a TCPStore on 127.0.0.1 for their rendezvous, a timeout on every
group. `ParallelRunner` is the engine's ModelRunner for them: the same ForwardBatch, KDA slot copies
queued and sent with the next step, and `restart()` for failover.

Failure: while the engine waits for a step, it watches every rank's pipe (the answer, the seconds or a
report) and every process's sentinel. A killed rank is seen at once (its sentinel); a hung one when its
peers' collectives or pipeline receives time out (parallel.group_timeout_s) and they report it. Either
way the whole group is killed and WorkerGroupError raised; `lost` says whether it was a lost process
(the engine restarts and recomputes, docs/design.md §10) rather than an exception in the model (the
engine restarts, then raises it like a one-process step).

The workers do not import the caller's main module (`_children_without_main`), so a script that builds
a parallel Engine needs no `if __name__ == "__main__":` guard, and `python - < script.py` works too.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import sys
import time
import types
from multiprocessing.connection import wait

import torch

from latentmoe_lab.model import CausalLMOutput
from latentmoe_lab.parallel.config import ParallelConfig
from latentmoe_lab.parallel.eplb.load import ExpertLoadRecorder
from latentmoe_lab.parallel.eplb.online import OnlineBalancer
from latentmoe_lab.parallel.launch import loopback_store
from latentmoe_lab.parallel.mesh import coords_rank
from latentmoe_lab.serving.cache_tiers.offload_tier import offload_counters
from latentmoe_lab.serving.model_runner import ModelRunner
from latentmoe_lab.serving.transport.pool_rows import rows_to_wire
from latentmoe_lab.serving.transport.tp_rows import gather_ranks, rank_shares
from latentmoe_lab.serving.workers.parallel_worker import answer_rank, pack_batch, run_worker
from latentmoe_lab.serving.workers.pipeline_stage import ServingStage

START_TIMEOUT_S = 120.0  # joining + loading weights, on a busy shared machine
STOP_TIMEOUT_S = 10.0
REPORT_GRACE_S = 0.5  # after a failure, how long the other ranks' reports may take to arrive
class WorkerGroupError(RuntimeError):
    """The worker group failed a step; it has been killed. lost: a rank died or hung (no exception of its own)."""

    def __init__(self, message: str, lost: bool):
        super().__init__(message)
        self.lost = lost


def worker_threads(section, layout: ParallelConfig) -> int:
    """Torch threads per worker process: ranks share the cores, one each; a lone forward process takes
    parallel.forward_threads, or (0) the default for the cores this process may use (latentmoe_lab/threads.py).
    section: the service's parallel section."""
    from latentmoe_lab.threads import default_threads

    if layout.world_size > 1:
        return 1
    return section.forward_threads or default_threads()


def weights_bytes(model) -> bytes:
    """The model's state as safetensors bytes, the form every worker (re)loads its weights from."""
    from safetensors.torch import save

    # clone: tied tensors (embedding and LM head) share storage, which safetensors refuses
    return save({name: tensor.detach().contiguous().clone() for name, tensor in model.state_dict().items()})


@contextlib.contextmanager
def _children_without_main():
    """Processes started inside do not import this process's `__main__`.

    A spawn or forkserver child first re-runs the parent's main script or module (as `__mp_main__`), so
    that functions defined there unpickle. A worker's target and arguments all come from this package, so
    the re-run buys nothing, and it breaks a script without an `if __name__ == "__main__":` guard (the
    child builds an Engine of its own while bootstrapping, which multiprocessing refuses) and a script
    read from stdin (there is no file to re-run). multiprocessing reads the main module from sys.modules
    when a child starts; a bare stand-in there, with no file and no spec, sends none.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _process_state(process) -> str | None:
    """'exited' or 'stopped' from Linux /proc (state Z / gone, T / t), None while it runs or sleeps. Read from
    /proc, not is_alive(): that reads the forkserver sentinel, which another thread may be reading."""
    try:
        with open(f"/proc/{process.pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "exited"
    except (OSError, IndexError):
        return None
    return {"Z": "exited", "X": "exited", "T": "stopped", "t": "stopped"}.get(state)


class WorkerGroup:
    """pp * tp * ep worker processes in one gloo group, started by start(), ended by close() or kill()."""

    def __init__(self, pconfig: ParallelConfig, config, stages: list[ServingStage], weights: bytes, threads: int = 1,
                 placement: torch.Tensor | None = None):
        self.pconfig, self.config, self.stages, self.weights = pconfig, config, stages, weights
        self.threads = threads  # torch threads of each rank
        self.placement = placement  # EPLB's expert slots [MoE layers, P] the workers start from, or None
        self.answer_rank = answer_rank(pconfig)  # the rank whose pipe brings the logits
        self.pool_bytes: list[int] = [0] * pconfig.world_size  # what each rank allocated, from its "ready"
        self.processes: list = []
        self.conns: list = []
        self._store = contextlib.ExitStack()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def start(self) -> "WorkerGroup":
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["latentmoe_lab.serving.workers.parallel_worker"])
        port = self._store.enter_context(loopback_store(self.pconfig.timeout_s))
        heartbeat = self.pconfig.timeout_s / 4
        for rank in range(self.pconfig.world_size):
            ours, theirs = context.Pipe()
            process = context.Process(target=run_worker, name=f"latentmoe-serve-rank{rank}", daemon=True,
                                      args=(rank, self.pconfig, port, self.config, self.stages, self.weights,
                                            theirs, heartbeat, self.threads, self.placement))
            with _children_without_main():
                process.start()
            theirs.close()
            self.processes.append(process)
            self.conns.append(ours)
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = set(range(len(self.conns)))
        while waiting:
            ready = wait([self.conns[r] for r in waiting] + [self.processes[r].sentinel for r in waiting],
                         timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise self._failure(f"workers {sorted(waiting)} did not start within {START_TIMEOUT_S}s")
            for rank in list(waiting):
                if self.conns[rank] in ready or self.processes[rank].sentinel in ready:
                    reply = self._receive(rank)
                    if reply is None or reply[0] != "ready":
                        raise self._failure(f"worker {rank} failed to start", reply)
                    self.pool_bytes[rank] = reply[2]
                    waiting.discard(rank)
        return self

    def step(self, header: dict, flat: torch.Tensor, features: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[float, float, int]], list, torch.Tensor | None]:
        """Send one step to rank 0 -> (logits [S, vocab] fp32, finite flags, every rank's (forward seconds,
        collective seconds, resident bytes) in rank order, every rank's expert load {"counts": its stage's
        routed tokens [L_stage, E], "moved": bytes its EPLB migration copied}, the hidden rows [H, hidden]
        fp32 at the step's hidden_index or None without one), once every rank has answered on its pipe
        (parallel_worker.py "loops"); WorkerGroupError on any failure."""
        # a hung rank makes its peers' collectives time out, and they report it; this deadline is the
        # backstop for a group that stops answering as a whole (a whole step may outlast one collective)
        replies = self._collect((header, flat.numpy(), None if features is None else features.numpy()), "step",
                                (self.pconfig.pp + 1) * self.pconfig.timeout_s,
                                lambda rank, kind: kind == ("logits" if rank == self.answer_rank else "seconds"))
        answer = replies[self.answer_rank]
        seconds = [answer[3] if rank == self.answer_rank else reply[1] for rank, reply in enumerate(replies)]
        loads = [answer[4] if rank == self.answer_rank else reply[2] for rank, reply in enumerate(replies)]
        return (torch.from_numpy(answer[1]), torch.from_numpy(answer[2]), seconds, loads,
                None if answer[5] is None else torch.from_numpy(answer[5]))

    def exchange_rows(self, header: dict) -> list[dict[str, torch.Tensor]]:
        """A "read_rows" or "write_rows" message of a prefill -> decode transfer (parallel_worker.exchange_rows)
        -> every rank's answer {name: tensor} in rank order (empty for a write). WorkerGroupError on any failure."""
        from latentmoe_lab.serving.transport.pool_rows import rows_from_wire

        replies = self._collect((header, None, None), header["kind"], self.pconfig.timeout_s,
                                lambda rank, kind: kind == "rows")
        return [rows_from_wire(reply[1]) for reply in replies]

    def _collect(self, message: tuple, what: str, timeout_s: float, expected) -> list:
        """Send `message` to rank 0 (it hands it to the group) -> every rank's one reply, in rank order.

        expected(rank, kind) says whether a reply of that kind is the one rank owes; anything else, a rank that
        dies, or no full set of replies within timeout_s: WorkerGroupError (the group is killed).
        """
        if not self.conns:
            raise self._failure("the group was killed after an earlier failure")
        try:
            self.conns[0].send(message)
        except OSError as error:
            raise self._failure(f"rank 0 cannot take the {what} ({error})") from None
        deadline = time.monotonic() + timeout_s
        replies: dict[int, tuple] = {}
        while len(replies) < len(self.conns):
            ready = wait(self.conns + [p.sentinel for p in self.processes],
                         timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise self._failure(f"no answer to the {what} within {timeout_s:g}s")
            for rank, conn in enumerate(self.conns):
                if conn in ready:
                    reply = self._receive(rank)
                    if reply is None or not expected(rank, reply[0]):
                        raise self._failure(f"rank {rank} failed the {what}", reply)
                    replies[rank] = reply
            dead = [r for r, p in enumerate(self.processes) if p.sentinel in ready]
            if dead:
                raise self._failure(f"rank {dead[0]} failed the {what}")
        return [replies[rank] for rank in range(len(self.conns))]

    def _receive(self, rank: int):
        """Rank's next message, or None when its pipe is closed (the process died without a word)."""
        try:
            return self.conns[rank].recv() if self.conns[rank].poll(0) else None
        except (EOFError, OSError):
            return None

    def _failure(self, what: str, first=None) -> WorkerGroupError:
        """Collect what the ranks reported, kill the group, and describe it (lost unless a rank raised)."""
        time.sleep(REPORT_GRACE_S)
        reports = [first] + [self._receive(r) for r in range(len(self.conns))]
        reports = [r for r in reports if r is not None and r[0] in ("error", "collective")]
        dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.processes)
                if p.exitcode not in (None, 1)]  # 1: a rank that reported its error and left
        self.kill()
        lost = not any(kind == "error" for kind, _ in reports)
        detail = "; ".join(text.splitlines()[0] for _, text in reports[:3]) or "no rank reported an error"
        killed = f"; killed or crashed: {', '.join(dead)}" if dead else ""
        return WorkerGroupError(f"parallel workers: {what}{killed}; {detail}", lost)

    def close(self) -> None:
        """Ask the group to stop, wait for it, then kill whatever is left."""
        if self.processes and self.processes[0].is_alive():
            with contextlib.suppress(OSError):
                self.conns[0].send(({"kind": "stop"}, None, None))
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(timeout=STOP_TIMEOUT_S)
        for conn in self.conns:
            conn.close()
        self.conns = []
        self._store.close()


class ParallelRunner(ModelRunner):
    """ModelRunner for a worker group: build_batch and encode_batch_images as in one process, the forward on the ranks.

    The engine's model stays whole here: the vision tower runs in this process, and restart() reloads the
    workers' weights from it. copy_slot (the scheduler's prefix snapshots) is queued and applied by every
    rank before the next step's forward, in order.
    """

    def __init__(self, model, stages: list[ServingStage], pconfig: ParallelConfig, threads: int = 1,
                 balancer: OnlineBalancer | None = None, recorder: ExpertLoadRecorder | None = None,
                 return_hidden: bool = False):
        super().__init__(model, stages[0].plan, return_hidden=return_hidden)
        self.stages, self.pconfig, self.threads = stages, pconfig, threads
        # EPLB (parallel/eplb/online.py): the balancer reads the recorder's window and hands the workers
        # placement updates with the steps; eplb_bytes_moved sums what their migrations copied
        self.balancer, self.recorder = balancer, recorder
        self.eplb_bytes_moved = 0
        self.rank_expert_pairs = [0] * pconfig.world_size  # (token, expert) pairs each rank's experts computed
        self.rank_offload: list[dict | None] = [None] * pconfig.world_size  # OffloadedPools.stats() of each rank
        self.last_expert_counts: torch.Tensor | None = None  # [MoE layers, E] of the last step
        self._steps = 0
        self.restarts = 0
        self.restarts_in_a_row = 0  # since the last step that succeeded
        # every rank's forward and collective seconds, summed over steps (across group restarts too)
        self.rank_forward_seconds = [0.0] * pconfig.world_size
        self.rank_collective_seconds = [0.0] * pconfig.world_size
        self.rank_resident_bytes = [0] * pconfig.world_size  # at each rank's last step
        self._copies: list[tuple[int, int]] = []
        self.group = self._start_group()

    def _allocate(self, plan) -> None:
        """No pools here: every rank allocates its own (parallel_worker.py); rows travel by message."""
        return None

    def _start_group(self) -> WorkerGroup:
        """A fresh group: weights loaded from the engine's model, empty pools, and EPLB's expert slots with every
        update handed out so far."""
        placement = None if self.balancer is None else self.balancer.placement.clone()
        return WorkerGroup(self.pconfig, self.model.config, self.stages, weights_bytes(self.model), self.threads,
                           placement).start()

    def expert_counts(self) -> torch.Tensor:
        return self.last_expert_counts

    @property
    def pids(self) -> list[int]:
        return self.group.pids

    def copy_slot(self, src: int, dst: int) -> None:
        self._copies.append((src, dst))

    def read_rows(self, positions: torch.Tensor, slot: int | None) -> dict[str, torch.Tensor]:
        """ModelRunner.read_rows over the ranks, after the queued slot copies: each rank's rows gathered
        into the whole-model layout (transport/tp_rows.py: heads over tp, layers over pipeline stages)."""
        header = {"kind": "read_rows", "positions": positions.tolist(), "slot": slot, "copies": self._copies}
        self._copies = []
        return gather_ranks(self.group.exchange_rows(header), self.pconfig, self.model.config)

    def write_rows(self, positions: torch.Tensor, slot: int | None, rows: dict[str, torch.Tensor]) -> None:
        """ModelRunner.write_rows over the ranks, after the queued slot copies: each its share of the rows."""
        shares = rank_shares(rows, self.pconfig, self.model.config, self.stages)
        header = {"kind": "write_rows", "positions": positions.tolist(), "slot": slot, "copies": self._copies,
                  "shares": [rows_to_wire(share) for share in shares]}
        self._copies = []
        self.group.exchange_rows(header)

    def offload_stats(self) -> dict[str, int]:
        """ModelRunner.offload_stats from the ranks' counters of their last step (the first rank of each stage;
        zeros before the first step, and again after a restart: its pools are new)."""
        if not self.stages[0].plan.hot_rows:
            return {}
        stages = [self.rank_offload[coords_rank(self.pconfig, {"pp": stage})] for stage in range(self.pconfig.pp)]
        return offload_counters([stats for stats in stages if stats is not None])

    def worker_stats(self) -> dict:
        """Restarts, and per rank the forward and collective seconds summed over steps and the resident bytes."""
        return {"worker_restarts": self.restarts, "rank_forward_seconds": list(self.rank_forward_seconds),
                "rank_collective_seconds": list(self.rank_collective_seconds),
                "rank_resident_bytes": list(self.rank_resident_bytes)}

    def unavailable_workers(self) -> list[str]:
        """Ranks whose process has exited or is stopped (SIGSTOP): a server's /health reports them."""
        if not self.group.conns:
            return ["processes: none running (the group is restarted at the next step)"]
        return [f"rank {rank} (pid {p.pid}) {state}" for rank, p in enumerate(self.group.processes)
                if (state := _process_state(p)) is not None]

    @torch.no_grad()
    def run(self, batch) -> CausalLMOutput:
        """Run one step on the workers -> CausalLMOutput(logits [S, vocab] fp32, finite, hidden [H, hidden] in
        the model's dtype with return_hidden), as ModelRunner.run."""
        start = time.monotonic()
        header, flat, features = pack_batch(self.build_batch(batch), self._copies)
        if self.balancer is not None:
            header["eplb"] = self.balancer.updates(self.recorder.window, self._steps)
        self._copies = []
        self.last_build_time = time.monotonic() - start
        logits, finite, seconds, loads, hidden = self.group.step(header, flat, features)
        for rank, (forward, collective, resident) in enumerate(seconds):
            self.rank_forward_seconds[rank] += forward
            self.rank_collective_seconds[rank] += collective
            self.rank_resident_bytes[rank] = resident
        # each stage's first rank has its layers' counts (every EP rank routes every token)
        self.last_expert_counts = torch.cat([torch.from_numpy(loads[coords_rank(self.pconfig, {"pp": s})]["counts"])
                                             for s in range(self.pconfig.pp)])
        self.eplb_bytes_moved += sum(load["moved"] for load in loads)
        self.rank_expert_pairs = [load["pairs"] for load in loads]  # since the group started
        self.rank_offload = [load["offload"] for load in loads]  # memory.offload counters, since the group started
        self._steps += 1
        self.restarts_in_a_row = 0
        if hidden is not None:  # sent widened to fp32 (parallel_worker._wire): back to the drafter's dtype, exactly
            hidden = hidden.to(next(self.model.parameters()).dtype)
        return CausalLMOutput(logits=logits, finite=finite, hidden=hidden)

    def restart(self) -> None:
        """A fresh group with the weights reloaded and empty pools (the engine recomputes every sequence)."""
        self.group.kill()
        self._copies = []
        self.restarts += 1
        self.restarts_in_a_row += 1
        self.group = self._start_group()

    def close(self) -> None:
        self.group.close()
