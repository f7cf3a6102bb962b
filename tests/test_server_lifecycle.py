"""`latentmoe-lab serve` as a process: every stop path runs the one shutdown (server/lifecycle.py).

SIGTERM (what kill, systemd, docker and Kubernetes send) used to end the process before engine.close(), so the
prefix cache never reached memory.prefix_cache.disk_dir; now SIGTERM, SIGHUP, SIGINT and the parent going away
flush it, and a restart on the same directory serves disk hits. A port already in use is refused in one line,
exit 2, before anything is loaded. Loopback only, every wait bounded.
"""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from latentmoe_lab.server.lifecycle import SHUTDOWN_TIMEOUT_S, StopRequests
from latentmoe_lab.server.threaded import free_port

REPO = Path(__file__).resolve().parents[1]
PROMPT = "import os\nimport sys\n" * 4  # 80 bytes: 5 blocks of 16
SERVICE = """model: {{name: m, preset: tiny, seed: 0, max_model_len: 512}}
memory: {{max_num_seqs: 4, block_size: 16, cache_bytes: 4000000,
         prefix_cache: {{snapshot_slots: 4, host_bytes: 0, disk_dir: {disk_dir}}}}}
scheduler: {{max_batch_size: 4, prefill_chunk_size: 128}}
"""
UP_TIMEOUT_S = 300  # generous: a shared 2-core machine under load imports torch slowly
STOP_TIMEOUT_S = SHUTDOWN_TIMEOUT_S + 30  # serve's own bound, and then some


def _hangup_default() -> None:
    """A child's SIGHUP back to its default action. A test run started under nohup hands every process it
    starts SIGHUP ignored, and serve rightly keeps it ignored then (test_nohup_keeps_sighup_ignored...):
    the tests of the terminal closing and of the parent watch need a serve started from a terminal."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _start(config: Path, port: int, log: Path, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "latentmoe_lab", "serve", "--config", str(config),
                             "--port", str(port), "--threads", "1"], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=log.open("w"), preexec_fn=_hangup_default, **popen)


def _wait_up(url: str, alive) -> None:
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert alive(), "serve exited during start-up"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"serve did not answer /health within {UP_TIMEOUT_S} s")


def _stopped(process: subprocess.Popen, sig: int) -> int:
    process.send_signal(sig)
    try:
        return process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)
        pytest.fail(f"serve did not stop within {STOP_TIMEOUT_S} s of {signal.Signals(sig).name}")


def _complete(url: str) -> None:
    reply = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 2}, timeout=60)
    assert reply.status_code == 200, reply.text


@pytest.mark.slow
def test_sigterm_flushes_the_prefix_cache_and_a_restart_hits_the_disk(tmp_path):
    disk_dir = tmp_path / "spill"
    config = tmp_path / "service.yaml"
    config.write_text(SERVICE.format(disk_dir=disk_dir))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = _start(config, port, tmp_path / "first.log")
    try:
        _wait_up(url, lambda: process.poll() is None)
        _complete(url)
        assert _stopped(process, signal.SIGTERM) == 0
    finally:
        if process.poll() is None:
            process.kill()
    log = (tmp_path / "first.log").read_text()
    assert "shutdown (SIGTERM)" in log and f"prefix cache flushed to {disk_dir}" in log, log[-2000:]
    assert "Traceback" not in log, log[-3000:]
    assert list(disk_dir.glob("*/*.safetensors")), "SIGTERM wrote nothing to memory.prefix_cache.disk_dir"

    process = _start(config, port, tmp_path / "second.log")
    try:
        _wait_up(url, lambda: process.poll() is None)
        _complete(url)
        assert httpx.get(url + "/health", timeout=5).json()["prefix_hits_disk"] >= 1
        assert _stopped(process, signal.SIGHUP) == 0  # the terminal closed: the same shutdown
    finally:
        if process.poll() is None:
            process.kill()
    assert "shutdown (SIGHUP)" in (tmp_path / "second.log").read_text()


@pytest.mark.slow
def test_the_parent_going_away_stops_serve_through_the_same_shutdown(tmp_path):
    """A parent that dies by SIGKILL (a supervisor, a test runner) leaves no orphan server behind."""
    config = tmp_path / "service.yaml"
    config.write_text(SERVICE.format(disk_dir=tmp_path / "spill"))
    port = free_port()
    log = tmp_path / "serve.log"
    parent = subprocess.Popen(  # the parent prints serve's pid, then waits on it
        [sys.executable, "-c", "import subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, "
         f"stderr=open({str(log)!r}, 'w')); print(p.pid, flush=True); p.wait()",
         sys.executable, "-m", "latentmoe_lab", "serve", "--config", str(config), "--port", str(port),
         "--threads", "1"], cwd=REPO, stdout=subprocess.PIPE, text=True, preexec_fn=_hangup_default)
    serve_pid = int(parent.stdout.readline())
    try:
        _wait_up(f"http://127.0.0.1:{port}", lambda: _exists(serve_pid))
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while _exists(serve_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _exists(serve_pid), "serve outlived its parent"
    finally:
        if _exists(serve_pid):
            os.kill(serve_pid, signal.SIGKILL)
    assert "shutdown (parent process gone)" in log.read_text(), log.read_text()[-2000:]


def _exists(pid: int) -> bool:
    """pid is a live process (not a zombie: an orphan is reaped by init, which may take a moment)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_sigterm_during_loading_stops_cleanly_without_a_traceback(tmp_path):
    config = tmp_path / "service.yaml"
    config.write_text(SERVICE.format(disk_dir=tmp_path / "spill").replace(
        "max_model_len: 512}", "max_model_len: 512}\nparallel: {forward_process: true}"))
    log = tmp_path / "serve.log"
    process = _start(config, free_port(), log)
    try:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while "loading ..." not in log.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            time.sleep(0.05)
        assert _stopped(process, signal.SIGTERM) == 0
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text()
    assert "Traceback" not in text and "shutdown (SIGTERM)" in text, text[-3000:]


def test_a_port_in_use_is_one_line_and_exit_2_before_loading(tmp_path):
    config = tmp_path / "service.yaml"
    config.write_text(SERVICE.format(disk_dir=tmp_path / "spill"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "latentmoe_lab", "serve", "--config", str(config),
                                 "--port", str(port)], cwd=REPO, capture_output=True, text=True, timeout=UP_TIMEOUT_S)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (f"latentmoe-lab serve: error: --port: 127.0.0.1:{port} is already in use "
                                     "(another server?); stop it or choose another --port")


def test_nohup_keeps_sighup_ignored_and_the_parent_unwatched():
    """A serve started with SIGHUP ignored (nohup) outlives its terminal and its parent: StopRequests leaves
    SIGHUP ignored and starts no parent watch; otherwise it handles SIGHUP like SIGTERM."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopRequests() as stop:
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and not stop._watch_parent
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        with StopRequests() as stop:
            assert signal.getsignal(signal.SIGHUP) == stop._on_signal
            os.kill(os.getpid(), signal.SIGHUP)
            assert stop.requested.wait(5) and stop.reason == "SIGHUP"
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, previous)
