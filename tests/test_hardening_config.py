"""Issue 12 items 4, 7, 8 and the chunk-size cap of 10: typed config fields, explicit text / file loaders."""
import json
import math
import os
import threading

import pytest

from latentmoe_lab.config import MAX_KDA_CHUNK_SIZE, ModelConfig
from latentmoe_lab.config_fields import ConfigTypeError


def _tiny_with(**changes):
    data = ModelConfig.from_preset("tiny").to_dict()
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key].update(value)
        else:
            data[key] = value
    return data


@pytest.mark.parametrize("changes, field", [
    (dict(rms_norm_eps=math.inf), "rms_norm_eps"),
    (dict(rms_norm_eps=math.nan), "rms_norm_eps"),
    (dict(initializer_range=-math.inf), "initializer_range"),
    (dict(moe=dict(routed_scaling_factor=math.inf)), "moe.routed_scaling_factor"),
    (dict(moe=dict(bias_update_rate=math.nan)), "moe.bias_update_rate"),
    (dict(moe=dict(activation_clamp=math.inf)), "moe.activation_clamp"),
    (dict(kda=dict(gate_lower_bound=-math.inf)), "kda.gate_lower_bound"),
])
def test_non_finite_floats_are_refused(changes, field):
    with pytest.raises(ValueError, match=rf"^{field}: must be a finite number"):
        ModelConfig.from_dict(_tiny_with(**changes))


@pytest.mark.parametrize("changes, field, error", [
    (dict(kda=5), "kda", TypeError),
    (dict(vision="yes"), "vision", TypeError),
    (dict(rms_norm_eps="1e-6"), "rms_norm_eps", TypeError),
    (dict(initializer_range=0.0), "initializer_range", ValueError),
    (dict(initializer_range="0.02"), "initializer_range", TypeError),
    (dict(kda=dict(output_gate_rank=2.5)), "kda.output_gate_rank", TypeError),
    (dict(kda=dict(chunk_size=MAX_KDA_CHUNK_SIZE * 2)), "kda.chunk_size", ValueError),
    (dict(layer_types="kdakdakdadsa"), "layer_types", TypeError),
    (dict(layer_types=["kda", "kda", 3, "dsa"]), r"layer_types\[2\]", TypeError),
    (dict(name=["a"] * 3), "name", TypeError),
    (dict(name="x" * 10_000), "name", ValueError),
    (dict(tie_word_embeddings=1), "tie_word_embeddings", TypeError),
    (dict(final_layer_dsa="false"), "final_layer_dsa", TypeError),
    (dict(hidden_size=64.0), "hidden_size", TypeError),
    (dict(vocab_size=2 ** 70), "vocab_size", ValueError),
    (dict(kda=dict(gate_form=7)), "kda.gate_form", TypeError),
    (dict(vision=dict(image_token_id=True)), "vision.image_token_id", TypeError),
])
def test_every_field_is_typed_where_declared(changes, field, error):
    with pytest.raises(error, match=rf"^{field}: "):
        ModelConfig.from_dict(_tiny_with(**changes))


def test_type_errors_are_also_value_errors_and_ints_become_floats():
    assert issubclass(ConfigTypeError, TypeError) and issubclass(ConfigTypeError, ValueError)
    cfg = ModelConfig.from_dict(_tiny_with(rms_norm_eps=1, moe=dict(routed_scaling_factor=2)))
    assert type(cfg.rms_norm_eps) is float and type(cfg.moe.routed_scaling_factor) is float
    cfg.kda.chunk_size = "16"  # in-place edits are checked by validate() too
    with pytest.raises(TypeError, match="^kda.chunk_size: expected int"):
        cfg.validate()


def test_yaml_alias_bomb_in_name_is_refused_fast():
    # 9 levels of 9 aliases: 9^9 = 387M leaves once printed (repr / to_json hung); a few hundred bytes parsed
    levels = ["&l0 [x, x, x, x, x, x, x, x, x]"] + [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]"
                                                   for i in range(1, 10)]
    text = ModelConfig.from_preset("tiny").to_yaml().replace("name: tiny", "name: [" + ", ".join(levels) + "]")
    with pytest.raises(TypeError, match="^name: expected str, got a value of type list"):
        ModelConfig.from_yaml_text(text)


def test_text_and_file_loaders_are_explicit(tmp_path):
    cfg = ModelConfig.from_preset("tiny")
    text = json.dumps(cfg.to_dict())  # one line, 2 KB: used to be taken for a file name (OSError)
    assert ModelConfig.from_json_text(text) == cfg
    assert ModelConfig.from_yaml_text(cfg.to_yaml()) == cfg
    cfg.to_json(tmp_path / "c.json")
    cfg.to_yaml(tmp_path / "c.yaml")
    assert ModelConfig.from_json_file(tmp_path / "c.json") == cfg == ModelConfig.from_json(str(tmp_path / "c.json"))
    assert ModelConfig.from_yaml_file(tmp_path / "c.yaml") == cfg == ModelConfig.from_yaml(tmp_path / "c.yaml")
    with pytest.raises(ValueError, match="^path: cannot open.*for JSON text use ModelConfig.from_json_text"):
        ModelConfig.from_json(text)  # a name too long for the file system
    with pytest.raises(ValueError, match="^path: no file at.*for YAML text use ModelConfig.from_yaml_text"):
        ModelConfig.from_yaml("name: tiny")
    with pytest.raises(ValueError, match="^path: the path is empty"):
        ModelConfig.from_json("")
    with pytest.raises(ValueError, match="is not a regular file"):
        ModelConfig.from_yaml_file(tmp_path)
    with pytest.raises(TypeError, match="^path: expected a file path"):
        ModelConfig.from_json_file(3)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    outcome = []
    reader = threading.Thread(target=lambda: outcome.append(_error_of(ModelConfig.from_json_file, fifo)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "reading a FIFO hung"
    assert isinstance(outcome[0], ValueError) and "not a regular file" in str(outcome[0])


def _error_of(function, *args):
    try:
        function(*args)
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return error
    return None


@pytest.mark.parametrize("loader, text", [
    (ModelConfig.from_json_text, '{"name": "tiny",'),
    (ModelConfig.from_json_text, "[" * 100_000 + "]" * 100_000),
    (ModelConfig.from_json_text, '{"vocab_size": ' + "9" * 5000 + "}"),
    (ModelConfig.from_yaml_text, "name: [unclosed"),
    (ModelConfig.from_yaml_text, "a: *undefined_alias"),
])
def test_parse_errors_are_value_errors(loader, text):
    with pytest.raises(ValueError, match="^text: not valid (JSON|YAML)"):
        loader(text)
