"""The service file's `server:` section and the serve command's checks (docs/design.md §10)."""
import pytest

from latentmoe_lab.cli import main
from latentmoe_lab.server.loading import load_model, with_checkpoint
from latentmoe_lab.server.settings import SERVER_LOG_RECORDS, ServerSettings, load_service_file, split_service_dict
from latentmoe_lab.server.worker import EngineWorker
from latentmoe_lab.serving import ServiceConfig


def test_server_section_is_split_off_and_checked():
    config, settings = split_service_dict({"model": {"preset": "tiny"}, "server": {"max_retries": 5}})
    assert config.model.preset == "tiny" and settings.max_retries == 5 and settings == ServerSettings(max_retries=5)
    assert split_service_dict({"model": {"preset": "tiny"}})[1] == ServerSettings()
    for bad, match in [({"max_retry": 1}, r"server\.max_retry: unknown key"),
                       ({"max_retries": -1}, r"server\.max_retries: must be an integer >= 0"),
                       ({"max_retries": True}, r"server\.max_retries"),
                       ({"step_timeout_s": 0}, r"server\.step_timeout_s"),
                       ({"max_body_bytes": "1MB"}, r"server\.max_body_bytes")]:
        with pytest.raises(ValueError, match=match):
            split_service_dict({"server": bad})
    with pytest.raises(ValueError, match=r"scheduler\.nope"):
        split_service_dict({"scheduler": {"nope": 1}})


def test_the_engine_gets_the_servers_retries_and_a_short_log():
    config, settings = split_service_dict({"model": {"preset": "tiny"}, "server": {"max_retries": 5}})
    assert config.scheduler.max_log_records == SERVER_LOG_RECORDS < ServiceConfig().scheduler.max_log_records
    assert split_service_dict({"scheduler": {"max_log_records": 7}})[0].scheduler.max_log_records == 7
    with pytest.raises(ValueError, match=r"scheduler\.max_step_retries: a service file sets it as server\.max_retries"):
        split_service_dict({"scheduler": {"max_step_retries": 1}})
    worker = EngineWorker(config, settings, model_factory=lambda: None)  # not started: nothing is built
    assert worker.config.scheduler.max_step_retries == 5 and worker.config.model == config.model


def test_shipped_config_loads_and_checkpoint_replaces_preset(tmp_path):
    config, settings = load_service_file("configs/service-cpu.yaml")
    assert config.model.preset and settings == ServerSettings()
    replaced = with_checkpoint(config, str(tmp_path))
    assert replaced.model.checkpoint == str(tmp_path) and replaced.model.preset is None
    with pytest.raises(ValueError, match="--config"):
        load_service_file(tmp_path / "missing.yaml")


def test_preset_weights_are_reproducible_across_reloads():
    config, _ = split_service_dict({"model": {"preset": "tiny", "seed": 3}})
    a, b = load_model(config), load_model(config)
    assert all((x == y).all() for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(ValueError, match="model.dtype"):
        load_model(split_service_dict({"model": {"preset": "tiny", "dtype": "fp8"}})[0])


def test_serve_refuses_bad_flags(tmp_path, capsys):
    assert main(["serve", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "--config" in capsys.readouterr().err
    assert main(["serve", "--config", "configs/service-cpu.yaml", "--port", "0"]) == 2
    assert "--port" in capsys.readouterr().err


def test_serve_threads_go_to_the_forward_process_and_the_server_keeps_one(capsys):
    import torch

    from latentmoe_lab.server.cli import _set_threads

    before = torch.get_num_threads()
    try:
        config = ServiceConfig.from_dict({"parallel": {"forward_process": True}})
        assert _set_threads(config, 3).parallel.forward_threads == 3 and torch.get_num_threads() == 1
        pinned = ServiceConfig.from_dict({"parallel": {"forward_process": True, "forward_threads": 2}})
        assert _set_threads(pinned, 3).parallel.forward_threads == 2  # the service file's own value wins
        in_process = ServiceConfig.from_dict({})
        assert _set_threads(in_process, 2).parallel.forward_threads == 0 and torch.get_num_threads() == 2
        said = capsys.readouterr().err.splitlines()  # serve prints its choice, like train and serve-bench
        assert said == ["torch threads: 1 in the server, 3 in the forward process (--threads)",
                        "torch threads: 1 in the server, 2 in the forward process (parallel.forward_threads)",
                        "torch threads: 2 (from --threads)"]
        with pytest.raises(ValueError, match="--threads: must be >= 1"):
            _set_threads(config, 0)
        with pytest.raises(ValueError, match="parallel.forward_threads: must be an integer >= 0"):
            ServiceConfig.from_dict({"parallel": {"forward_threads": -1}})
    finally:
        torch.set_num_threads(before)
