"""How `serve` starts and stops: the port first, then the model, then one shutdown for every stop path
(docs/design.md §10).

    port = bind_port(host, port)            # ValueError naming --port before anything is loaded
    with StopRequests() as stop:            # SIGTERM, SIGINT, SIGHUP, the parent process gone
        if not load(worker.start, stop):    # a stop during loading waits for the load (bounded), then stops
            ...
        serve(app, port, stop)              # uvicorn until a stop request
        line = shutdown(worker.stop, stop)  # the worker's stop, bounded by SHUTDOWN_TIMEOUT_S

Why our own handlers: uvicorn installs its SIGINT / SIGTERM handlers for the time it serves, then puts back
the ones it found and raises the signal again. With Python's default SIGTERM action that re-raise ended the
process before `finally: worker.stop()` ran, so engine.close() (a parallel engine's processes, the prefix
cache written to memory.prefix_cache.disk_dir) never happened. Here the handlers found are ours: they record the
request and let the code return to the one shutdown. SIGHUP (the terminal closed) stops the server too,
unless the process started with it ignored (nohup). The parent going away (the server re-parented, e.g.
its supervisor killed) is polled every PARENT_POLL_S and stops it the same way, again except under nohup.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Callable

SHUTDOWN_TIMEOUT_S = 90.0  # a stop request -> the process ends, whatever the worker's stop does
GRACE_S = 5  # uvicorn: in-flight responses get this long before their connections are closed
PARENT_POLL_S = 1.0
LOAD_POLL_S = 0.2


def bind_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound (not yet listening: clients get 'refused' until the model is loaded) to host:port;
    ValueError naming --port or --host when the address cannot be taken."""
    if not 0 < port < 65536:
        raise ValueError(f"--port: must be in [1, 65535], got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT leftovers do not block
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if error.errno == 98:  # EADDRINUSE
            raise ValueError(f"--port: {host}:{port} is already in use (another server?); stop it or choose "
                             f"another --port") from None
        raise ValueError(f"--host: cannot bind {host}:{port} ({error.strerror or error})") from None
    return sock  # not inherited by child processes (PEP 446)


class StopRequests:
    """Our handlers for SIGTERM, SIGINT and SIGHUP (the one ignored at start stays ignored) and the parent
    watch, for the duration of a `with`; `reason` is what asked first ('SIGTERM', 'parent process gone'),
    `requested` is set then, and a running uvicorn server given to `attach` is told to exit."""

    def __init__(self):
        self.requested = threading.Event()
        self.reason: str | None = None
        self._server = None
        self._previous: dict[int, object] = {}
        self._watch_parent = False
        self._parent = os.getppid()

    def __enter__(self) -> "StopRequests":
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            previous = signal.getsignal(sig)
            if sig == signal.SIGHUP and previous == signal.SIG_IGN:
                continue  # nohup: the user asked this process to outlive its terminal (and its parent)
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._watch_parent = signal.SIGHUP in self._previous and self._parent != 1
        if self._watch_parent:
            threading.Thread(target=self._parent_watch, name="parent-watch", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._watch_parent = False
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def attach(self, server) -> None:
        """uvicorn's Server: a stop request sets its should_exit (it polls it every 0.1 s)."""
        self._server = server
        if self.requested.is_set():
            server.should_exit = True

    def request(self, reason: str) -> None:
        if self.requested.is_set():
            if reason != self.reason:
                print(f"{reason}: already stopping ({self.reason}), at most {SHUTDOWN_TIMEOUT_S:g} s",
                      file=sys.stderr, flush=True)
            return
        self.reason = reason
        self.requested.set()
        if self._server is not None:
            self._server.should_exit = True

    def _on_signal(self, sig: int, frame) -> None:
        self.request(signal.Signals(sig).name)

    def _parent_watch(self) -> None:
        while self._watch_parent and not self.requested.is_set():
            if os.getppid() != self._parent:
                self.request("parent process gone")
                return
            time.sleep(PARENT_POLL_S)


def load(start: Callable[[], None], stop: StopRequests) -> bool:
    """Run `start` (the worker's load) on a thread, so that a stop request is seen at once; True when it
    finished without one. With a stop request during loading the load still runs to its end (it cannot be cut
    safely: a process being started would get half its arguments), bounded by SHUTDOWN_TIMEOUT_S; False then.
    An error of `start` is raised here."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            start()
        except BaseException as error:  # noqa: BLE001 - re-raised on the main thread
            failure.append(error)

    thread = threading.Thread(target=run, name="loader", daemon=True)
    thread.start()
    while thread.is_alive() and not stop.requested.is_set():
        thread.join(LOAD_POLL_S)
    if stop.requested.is_set() and thread.is_alive():
        print(f"{stop.reason} during loading: stopping once the load is done (at most {SHUTDOWN_TIMEOUT_S:g} s)",
              file=sys.stderr, flush=True)
        thread.join(SHUTDOWN_TIMEOUT_S)
        if thread.is_alive():
            _exit_now(f"the load did not finish within {SHUTDOWN_TIMEOUT_S:g} s of {stop.reason}")
    if failure:
        raise failure[0]
    return not stop.requested.is_set()


def serve(app, sock: socket.socket, stop: StopRequests, log_config: dict) -> None:
    """uvicorn on the bound socket until a stop request (its own SIGINT / SIGTERM handlers feed ours through
    the re-raise at its end)."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", log_config=log_config,
                                           timeout_graceful_shutdown=GRACE_S))
    stop.attach(server)
    if stop.requested.is_set():
        return
    shown = f"[{host}]" if ":" in host else host
    print(f"serving on http://{shown}:{port} (Ctrl-C or SIGTERM stops it)", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    if not stop.requested.is_set():  # uvicorn ended by itself (a startup failure): still the one shutdown
        stop.request("the HTTP server ended")


def shutdown(stop_worker: Callable[[], str | None], stop: StopRequests) -> None:
    """The worker's stop on a thread, bounded by SHUTDOWN_TIMEOUT_S; one line says why and what it did."""
    summary: list[str | None] = []
    thread = threading.Thread(target=lambda: summary.append(stop_worker()), name="shutdown", daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(SHUTDOWN_TIMEOUT_S)
    if thread.is_alive():
        _exit_now(f"the shutdown did not finish within {SHUTDOWN_TIMEOUT_S:g} s of {stop.reason}")
    done = summary[0] if summary else "the worker's stop failed (see above)"
    print(f"shutdown ({stop.reason or 'end'}) in {time.monotonic() - started:.1f} s: {done}", file=sys.stderr,
          flush=True)


def closed_line(config, written_before: int, stats: dict) -> str:
    """What closing an engine did, for the shutdown line: the prefix-cache bytes written to disk_dir by the
    close (and what the directory holds now), or that there is no disk tier."""
    disk_dir = config.memory.prefix_cache.disk_dir if config.memory.prefix_cache.spills else None
    if disk_dir is None:
        return "engine closed (no memory.prefix_cache.disk_dir: no prefix cache to keep)"
    written = stats.get("spill_bytes_host_to_disk", 0) - written_before
    errors = stats.get("spill_disk_write_errors", 0)
    return (f"engine closed; prefix cache flushed to {disk_dir}: {written:,} bytes written now, "
            f"{stats.get('spill_disk_bytes', 0):,} bytes held there" + (f", {errors} write errors" if errors else ""))


def _exit_now(why: str) -> None:
    """Past the bound: say so and end the process without running more Python (threads may still be in
    torch code, which an orderly interpreter exit would abort on); child processes see their channel close."""
    print(f"latentmoe-lab serve: error: {why}; exiting without a complete shutdown", file=sys.stderr, flush=True)
    os._exit(1)
