"""CLI and launcher hardening (issue 12, items 11-13): one-line errors, flags checked before any process
starts, safe result loading, a loopback-only rendezvous store, and the tie-aware token check."""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

import latentmoe_lab
from latentmoe_lab import cli
from latentmoe_lab.parallel import runs
from latentmoe_lab.parallel.launch import launch
from latentmoe_lab.parallel.parity import first_differences, parity_line


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if a command gets as far as starting processes or building the smoke model."""
    def refuse(*args, **kwargs):
        raise AssertionError("processes were spawned before the flags were checked")

    monkeypatch.setattr(runs, "launch", refuse)
    monkeypatch.setattr("latentmoe_lab.smoke.LatentMoEForCausalLM",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("model built before the image check")))


BAD_COMMANDS = {
    "ep does not divide the experts": (["parallel", "--ep", "3"], "ep: 3 must divide"),
    "ep zero": (["parallel", "--ep", "0"], "ep: must be a positive integer"),
    "tp does not divide the heads": (["parallel", "--tp", "3"], "tp: 3 must divide"),
    "more stages than layers": (["parallel", "--pp", "8"], "pp: 8 stages"),
    "zero micro-batches": (["parallel", "--micro-batches", "0"], "micro_batches: must be a positive integer"),
    "batch zero": (["parallel", "--ep", "2", "--batch", "0"], "batch: must be a positive integer"),
    "seq-len zero": (["parallel", "--ep", "2", "--seq-len", "0"], "seq_len: must be a positive integer"),
    "negative new tokens": (["parallel", "--ep", "2", "--new-tokens", "-1"], "new_tokens: must be a positive"),
    "nproc mismatch": (["parallel", "--ep", "2", "--nproc", "3"], "--nproc"),
    "longer than the context": (["parallel", "--ep", "2", "--seq-len", "5000"], "exceed max_position_embeddings"),
    "smoke zero tokens": (["smoke", "--new-tokens", "0"], "new_tokens: must be >= 1"),
    "smoke missing image": (["smoke", "--image", "/nonexistent.png"], "/nonexistent.png"),
}


@pytest.mark.parametrize("name", BAD_COMMANDS)
def test_bad_flags_print_one_line_and_exit_2_before_spawning(name, no_spawn, capsys):
    argv, message = BAD_COMMANDS[name]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in captured.err
    assert "launching" not in captured.err  # refused before any progress line claims a launch
    assert errors[0].startswith(f"latentmoe-lab {argv[0]}: error: ")


def test_debug_shows_the_traceback(no_spawn):
    with pytest.raises(ValueError, match="ep: 3 must divide"):
        cli.main(["--debug", "parallel", "--ep", "3"])
    with pytest.raises(ValueError, match="ep: 3 must divide"):
        cli.main(["parallel", "--ep", "3", "--debug"])  # after the subcommand too


def test_every_subcommand_accepts_debug():
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, sub in commands.items():
        assert any("--debug" in action.option_strings for action in sub._actions), name


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and latentmoe_lab.__version__ in capsys.readouterr().out


def test_parallel_module_outside_a_launcher_says_how_to_launch():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                            "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "latentmoe_lab.parallel", "--ep", "2"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "torchrun --nproc-per-node" in done.stderr and "latentmoe-lab parallel" in done.stderr


def test_run_settings_refuse_bad_values():
    for bad in (dict(batch=0), dict(seq_len=0), dict(new_tokens=0), dict(seed=-1), dict(timeout_s=0),
                dict(preset="k3-2.8t"), dict(tie_margin=float("nan")), dict(batch=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            runs.RunSettings(**bad)


def test_explicit_batch_and_length_are_kept():
    pconfig = runs.ParallelConfig(ep=2)
    assert runs.default_settings(pconfig, batch=6, seq_len=17).batch == 6
    with pytest.raises(ValueError, match="batch"):
        runs.default_settings(pconfig, batch=0)


# ---------------------------------------------------------------- launcher (two real 2-process launches)
class _NotATensor:
    pass


def _store_listeners():
    from latentmoe_lab.parallel.mesh import init_distributed

    init_distributed(20)
    port = int(os.environ["MASTER_PORT"])
    listening = [c.laddr.ip for c in psutil.Process(os.getppid()).net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    return {"port": port, "listening": listening, "tensor": torch.arange(3)}


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_rendezvous_store_listens_on_loopback_only(start_method):
    import signal

    before = signal.getsignal(signal.SIGINT)
    results = launch(_store_listeners, 2, timeout_s=90, start_method=start_method)
    assert signal.getsignal(signal.SIGINT) is before  # the elastic agent's handlers do not outlive the launch
    for result in results:
        assert result["listening"] == ["127.0.0.1"]
        assert torch.equal(result["tensor"], torch.arange(3))


def test_kernels_spawn_and_scripts_fork(monkeypatch):
    import types

    launch_module = importlib.import_module("latentmoe_lab.parallel.launch")  # the package exports launch()

    assert not launch_module.inside_kernel()
    shell = types.SimpleNamespace(kernel=object())
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    assert launch_module.inside_kernel()
    chosen = []
    monkeypatch.setattr(launch_module, "_start", lambda entry, args, nproc, port, method: chosen.append(method))
    with pytest.raises(launch_module.RankFailure):  # the stub starts nothing, so no rank reports
        launch(_unsafe_result, 2, timeout_s=5)
    assert chosen == ["spawn"]
    with pytest.raises(ValueError, match="start_method"):
        launch(_unsafe_result, 2, start_method="forkserver")


def _unsafe_result():
    return _NotATensor()


def test_results_are_loaded_with_weights_only():
    with pytest.raises(TypeError, match="rank 0 returned a value that is not safe to load"):
        launch(_unsafe_result, 2, timeout_s=60)


# ---------------------------------------------------------------- tie-aware token check
def _tokens(rows):
    return torch.tensor(rows, dtype=torch.int64)


def test_first_difference_at_a_near_tie_is_reported_with_its_margin():
    prompt = [[1, 2], [3, 4]]
    reference = _tokens([p + g for p, g in zip(prompt, [[5, 6, 7], [8, 9, 10]])])
    layout = _tokens([p + g for p, g in zip(prompt, [[5, 6, 7], [8, 11, 12]])])  # row 1 differs at step 1
    logits = torch.zeros(2, 3, 16)
    logits[1, 1, 11] = -3e-6  # the reference barely preferred 9 over 11
    diffs = first_differences(reference, layout, logits, prompt_len=2, tie_margin=1e-4)
    assert [(d.row, d.step, d.reference_token, d.layout_token, d.is_tie) for d in diffs] == [(1, 1, 9, 11, True)]
    assert diffs[0].margin == pytest.approx(3e-6, rel=1e-3)
    line = parity_line(diffs, 1e-4)
    assert "equal up to near-ties" in line and "margin 3.00e-06" in line and "<= 1e-04" in line
    report = runs.LayoutReport("EP2", runs.ParallelConfig(ep=2), 0.0, False, [{}], [{}], [{}],
                               token_differences=[d.__dict__ for d in diffs])
    assert report.tokens_match and not report.tokens_equal and runs.report_ok(report)
    assert "tie-aware" in runs.layout_summary(report)


def test_a_clear_preference_is_not_a_tie():
    reference, layout = _tokens([[1, 5, 6]]), _tokens([[1, 7, 6]])
    logits = torch.zeros(1, 2, 16)
    logits[0, 0, 5] = 0.5
    diffs = first_differences(reference, layout, logits, prompt_len=1, tie_margin=1e-4)
    assert len(diffs) == 1 and not diffs[0].is_tie and diffs[0].margin == pytest.approx(0.5)
    report = runs.LayoutReport("EP2", runs.ParallelConfig(ep=2), 0.0, False, [{}], [{}], [{}],
                               token_differences=[d.__dict__ for d in diffs])
    assert not report.tokens_match and not runs.report_ok(report)
    assert "generated tokens differ" in runs.layout_summary(report)


def test_equal_tokens_need_no_logits():
    tokens = _tokens([[1, 2, 3]])
    assert first_differences(tokens, tokens.clone(), torch.zeros(1, 2, 4), prompt_len=1) == []
    assert parity_line([], 1e-4) == "generated tokens equal: True"


def test_one_process_batch_change_is_judged_by_the_reference_margin():
    """The same model, prompt rows run alone vs batched: any greedy difference must sit at a near-tie."""
    model, prompt = runs.build_reference(runs.RunSettings(batch=4, seq_len=24, new_tokens=4))
    batched = model.generate(prompt, max_new_tokens=4)
    alone = torch.cat([model.generate(prompt[i:i + 1], max_new_tokens=4) for i in range(prompt.shape[0])])
    logits = runs.reference_step_logits(model, batched, prompt.shape[1])
    assert logits.shape == (4, 4, model.config.vocab_size)
    assert all(d.is_tie for d in first_differences(batched, alone, logits, prompt.shape[1]))


def _run_folder(folder, started, files=()):
    """A launch's run folder as the ranks leave it: started markers, then results, errors or stack dumps."""
    folder.mkdir()
    for rank in started:
        (folder / f"{rank}.started").write_text("1")
    for name, text in files:
        (folder / name).write_text(text)
    return folder


def test_the_failure_report_names_root_causes_before_the_ranks_they_took_down(tmp_path):
    report = importlib.import_module("latentmoe_lab.parallel.launch")._failure_report  # the package exports launch()
    folder = _run_folder(tmp_path / "a", [0, 1, 2], [("2.result", "")])
    assert report(folder, 3, {1: -9}, 30) == ("parallel run failed: rank 1 was killed by SIGKILL without reporting "
                                              "an error; rank 0 was stopped by the launcher after that failure")
    folder = _run_folder(tmp_path / "b", [0, 1], [("0.error", "ValueError: bad\ntraceback"),
                                                  ("1.collateral", "CollectiveError: peer gone\n")])
    assert report(folder, 2, {0: 1}, 30) == ("parallel run failed: rank 0 raised ValueError: bad; "
                                             "rank 1 stopped because a peer failed: CollectiveError: peer gone")
    folder = _run_folder(tmp_path / "c", [0, 1], [("0.collateral", "CollectiveError: peer gone\n")])
    assert report(folder, 2, {0: 1}, 30) == ("parallel run failed: rank 1 died without reporting an error "
                                             "(killed or crashed); rank 0 stopped because a peer failed: "
                                             "CollectiveError: peer gone")
    dump = ('Timeout (0:00:30)!\nThread 0x00007f01 (most recent call first):\n  File "/x/threading.py", line 9 in run\n'
            'Thread 0x00007f00 (most recent call first):\n  File "/x/gloo_wait.py", line 3 in connect\n'
            '  File "/x/mesh.py", line 40 in init_distributed\n  File "/x/work.py", line 7 in worker\n'
            '  File "/x/launch.py", line 117 in __call__\n')
    folder = _run_folder(tmp_path / "d", [0, 1], [("0.watchdog", dump), ("1.watchdog", "")])
    assert report(folder, 2, {0: 1}, 30) == (
        "parallel run failed: rank 0 was still running after the 30s timeout, in connect (gloo_wait.py:3) <- "
        "init_distributed (mesh.py:40) <- worker (work.py:7); rank 1 was stopped by the launcher after that failure")
    assert report(tmp_path / "e", 2, {}, 30) == "parallel run failed: the launcher failed before any rank started"


# ---------------------------------------------------------------- fast start, one-line errors (second outside reviews)
def test_help_and_version_do_not_import_torch():
    code = ("import sys\nfrom latentmoe_lab.cli import main\nfor argv in (['--version'], ['--help'], ['serv']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('heavy:', sorted(m for m in ('torch', 'plotly', 'latentmoe_lab.model') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().endswith("heavy: []"), done.stdout + done.stderr
    assert "invalid choice: 'serv'" in done.stderr


def test_the_lazy_parser_lists_what_the_full_one_does():
    """The table behind `--help` says what each command's own module says."""
    lazy, full = cli.build_parser([]), cli.build_parser()
    assert lazy.format_help() == full.format_help()
    for name, sub in full._subparsers._group_actions[0].choices.items():
        assert name in cli.COMMANDS
        assert sub.format_help() == cli.build_parser([name])._subparsers._group_actions[0].choices[name].format_help()


USER_ERROR_LINES = {
    "a directory": (IsADirectoryError(21, "Is a directory", "runs/x/model.safetensors"),
                    "runs/x/model.safetensors: Is a directory"),
    "no such device": (OSError(19, "No such device"), "[Errno 19] No such device"),
    "permission": (PermissionError(13, "Permission denied", "/root/x"), "/root/x: Permission denied"),
    "allocator": (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                               "memory: you tried to allocate 40000000000000 bytes. Error code 12"),
                  "out of memory (can't allocate memory: you tried to allocate 40000000000000 bytes. Error code 12)"),
    "memory": (MemoryError(), "out of memory (MemoryError)"),
    "overflow": (OverflowError("Python int too large to convert to C ssize_t"), "Python int too large"),
    "two lines": (ValueError("model.block_size: bad\n  in line 3"), "model.block_size: bad in line 3"),
}


@pytest.mark.parametrize("name", USER_ERROR_LINES)
def test_user_errors_print_one_line_and_exit_2(name, monkeypatch, capsys):
    error, line = USER_ERROR_LINES[name]

    def command(args):
        raise error

    monkeypatch.setattr(cli, "cmd_info", command)
    assert cli.main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"latentmoe-lab info: error: {line}"), err
    with pytest.raises(type(error)):
        cli.main(["info", "--debug"])


@pytest.mark.parametrize("error", [RuntimeError("a bug"), KeyError("exp_avg"), AssertionError()])
def test_bugs_keep_their_traceback(error, monkeypatch):
    monkeypatch.setattr(cli, "cmd_info", lambda args: (_ for _ in ()).throw(error))
    assert cli.user_error_message(error) is None
    with pytest.raises(type(error)):
        cli.main(["info"])


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a command builds or loads a model."""
    from latentmoe_lab.model import LatentMoEForCausalLM

    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the flags were checked")

    monkeypatch.setattr(LatentMoEForCausalLM, "__init__", refuse)
    monkeypatch.setattr(LatentMoEForCausalLM, "from_pretrained", refuse)


def _early_refusals(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    service = str(Path(__file__).resolve().parents[1] / "configs" / "service-cpu.yaml")
    bench = ["serve-bench", "--config", service]
    return {
        "align threshold below the metric": (["align", "--candidate", "bf16", "--threshold", "rel_l2=-1"],
                                             "--threshold: rel_l2 takes values in [0, inf], got -1.0"),
        "align report is a directory": (["align", "--candidate", "bf16", "--report", str(tmp_path)],
                                        f"--report: '{tmp_path}' is a directory"),
        "align missing text": (["align", "--candidate", "bf16", "--text", str(tmp_path / "no.txt")], "--text"),
        "align stride": (["align", "--candidate", "bf16", "--stride", "0"], "--stride, --max-tokens: must be >= 1"),
        "bench requests": ([*bench, "--requests", "0"], "--requests: must be >= 1, got 0"),
        "bench rate": ([*bench, "--rate", "nan"], "--rate: must be a finite number > 0"),
        "bench tokens": ([*bench, "--max-tokens", "5000"], "--max-tokens: must be >= 1 and below"),
        "bench report under a file": ([*bench, "--report", str(a_file / "x.html")], "is a file, not a directory"),
        "smoke report is a directory": (["smoke", "--report", str(tmp_path)], f"--report: '{tmp_path}' is a directory"),
        "profile device": (["profile", "--device", "nodevice"], "--device: Expected one of cpu"),
        "profile out is a file": (["profile", "--out", str(a_file)], "--out:"),
    }


def test_flags_and_paths_are_refused_before_any_model_is_built(tmp_path, no_model, capsys):
    for name, (argv, message) in _early_refusals(tmp_path).items():
        assert cli.main(argv) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and "building" not in err, (name, err)


def test_plan_service_refuses_an_unknown_preset_before_planning(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["plan-service", "configs/service-example.yaml", "--preset", "k3"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "invalid choice: 'k3'" in err and "planning" not in err
    assert err.count("\n") == 1 and err.startswith("latentmoe-lab plan-service: error: argument --preset")


def test_make_lab_keeps_allow_root_with_lab_args():
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["make", "-n", "--no-print-directory", "-o", ".venv/.installed", "lab",
                           "LAB_ARGS=--no-browser --port 8899"],
                          cwd=root, capture_output=True, text=True, check=True)
    command = next(line for line in done.stdout.splitlines() if "jupyter lab" in line)
    assert "--no-browser --port 8899" in command
    assert ("--allow-root" in command) == (os.geteuid() == 0)


def test_profiler_noise_is_held_back_and_real_lines_are_kept(capfd):
    from latentmoe_lab.profiling.quiet import native_stderr_without

    with native_stderr_without():
        os.write(2, b"USDT:2026-12-02 04:40:56 14851:14851 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
                    b"[W1202 04:40:56.260431877 CPUAllocator.cpp:245] Memory block of unknown size was allocated "
                    b"before the profiling started, profiler results will not include the deallocation event\n"
                    b"a real warning\n")
        print("stderr from Python", file=sys.stderr)
    assert sorted(capfd.readouterr().err.splitlines()) == ["a real warning", "stderr from Python"]


def test_profile_prints_a_summary_and_no_profiler_noise(tmp_path, capfd):
    assert cli.main(["profile", "--prompt-len", "16", "--out", str(tmp_path)]) == 0
    out, err = capfd.readouterr()
    assert "tiny, prefill, batch 1, 16 tokens: the traced call took" in out
    assert "time by component (exclusive): " in out
    # (the heaviest may be an autograd.Function's own node, e.g. the norms' _RowNorm; aten ops follow)
    heaviest = next(line for line in out.splitlines() if line.startswith("heaviest ops (exclusive): "))
    assert "aten::" in heaviest
    assert "USDT" not in err and "CPUAllocator" not in err
