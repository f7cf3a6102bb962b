"""Issue 12 items 4, 7, 8 and the chunk-size cap of 10: typed config fields, explicit text / file loaders."""
import json
import math
import os
import threading
from pathlib import Path

import pytest

from latentmoe_lab.config import MAX_KDA_CHUNK_SIZE, ModelConfig
from latentmoe_lab.config_fields import ConfigTypeError

CONFIG_DIR = Path(__file__).parents[1] / "configs"


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


def _alias_bomb(levels=9):
    """9 levels of 9 aliases: 9^9 = 387M leaves once walked or printed, from a few hundred bytes of YAML."""
    parts = ["&l0 [x, x, x, x, x, x, x, x, x]"] + [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]"
                                                  for i in range(1, levels + 1)]
    return "[" + ", ".join(parts) + "]"


def test_yaml_alias_bomb_in_name_is_refused_fast():
    text = ModelConfig.from_preset("tiny").to_yaml().replace("name: tiny", "name: " + _alias_bomb())
    with pytest.raises(ValueError, match=r"^text, line 1, column 8: anchors \(&l0\) are not allowed"):
        ModelConfig.from_yaml_text(text)


def test_a_shared_nested_value_is_described_in_200_characters():
    """The same bomb built in Python (from_dict): the error shows a bounded prefix, never the whole tree."""
    bomb = ["x"] * 9
    for _ in range(9):
        bomb = [bomb] * 9
    with pytest.raises(TypeError, match=r"^name: expected str, got list \[\[\[\[\.\.\.\]") as caught:
        ModelConfig.from_dict(_tiny_with(name=bomb))
    assert len(str(caught.value)) < 260


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
    with pytest.raises(ValueError, match=r"^text(: not valid JSON|, line \d+, column \d+: )"):
        loader(text)


# --- the one YAML loader of config files (yaml_loader.py): the outside reliability review's YAML cases ---

@pytest.mark.parametrize("text, message", [
    ("a: &x 1\nb: *x\n", r"line 1, column 4: anchors \(&x\) are not allowed"),
    ("a: *x\n", r"line 1, column 4: aliases \(\*x\) are not allowed"),
    ("a: !!python/object/apply:os.system ['true']\n", r"line 1, column 4: explicit tags \(!!python/object/apply"),
    ("a: !!binary aGk=\n", r"line 1, column 4: explicit tags \(!!binary\)"),
    ("a:\n  b: 1\n  c: 2\n  b: 3\n", r"line 4, column 3: duplicate key 'b' \(first at line 2\)"),
    ("1: a\nnull: b\n", r"line 1, column 1: mapping keys must be strings, got 1"),
    ("? [a, b]\n: c\n", r"line 1, column 3: mapping keys must be strings, got list"),
    ("a:\n\tb: 1\n", r"line 2, column 1: not valid YAML: .*cannot start any token"),
    ("a: [64\n", r"line 2, column 1: not valid YAML: .*flow sequence"),
    ("a: 1\n---\nb: 2\n", r"line 2, column 1: not valid YAML: expected a single document"),
    ("a: b\0c\n", r"line 1, column 5: not valid YAML: the character #x0000 is not allowed"),
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", r"line 1, column \d+: (nested more than 32|not valid YAML)"),
    ("a: " + "[" * 40 + "]" * 40 + "\n", r"line 1, column 35: nested more than 32 levels deep"),
    ("a: " + "9" * 5000 + "\n", r"line 1, column 4: an integer of 5000 digits; at most 30"),
    ("# nothing\n", r"holds no YAML value"),
])
def test_the_config_yaml_loader_refuses_by_line_and_column(text, message):
    from latentmoe_lab.yaml_loader import parse_yaml

    with pytest.raises(ValueError, match=rf"^f\.yaml[,:] {message}") as caught:
        parse_yaml(text, "f.yaml")
    assert "\n" not in str(caught.value)


def test_plain_scalars_are_read_as_yaml_1_2_without_octal_or_hex():
    from latentmoe_lab.yaml_loader import parse_yaml

    data = parse_yaml("a: 1:04\nb: 010\nc: 0x40\nd: 1_000\ne: yes\nf: on\ng: 2001-12-14\nh: 64\ni: -3\n"
                      "j: 1e-6\nk: 0.5\nl: .inf\nm: true\nn: ~\no: +7\n")
    assert data == {"a": "1:04", "b": "010", "c": "0x40", "d": "1_000", "e": "yes", "f": "on", "g": "2001-12-14",
                    "h": 64, "i": -3, "j": 1e-6, "k": 0.5, "l": math.inf, "m": True, "n": None, "o": 7}
    assert parse_yaml("yes: 1\n") == {"yes": 1}  # a string key, not True
    with pytest.raises(TypeError, match=r"block_size: expected int, got '1:04'"):
        from latentmoe_lab.serving import ServiceConfig

        ServiceConfig.from_dict({"memory": parse_yaml("block_size: 1:04")})


def test_python_tags_never_run(tmp_path):
    from latentmoe_lab.yaml_loader import read_yaml_file

    marker = tmp_path / "ran"
    path = tmp_path / "c.yaml"
    path.write_text(f"name: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ValueError, match="explicit tags"):
        read_yaml_file(path)
    with pytest.raises(ValueError, match="explicit tags"):
        ModelConfig.from_yaml(path)
    assert not marker.exists()


def test_yaml_files_are_refused_before_reading_when_not_a_small_regular_file(tmp_path):
    from latentmoe_lab.yaml_loader import read_yaml_file

    fifo = tmp_path / "c.fifo"
    os.mkfifo(fifo)
    outcome = []
    reader = threading.Thread(target=lambda: outcome.append(_error_of(read_yaml_file, fifo)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive() and "not a regular file" in str(outcome[0])
    huge = tmp_path / "huge.yaml"
    with open(huge, "wb") as handle:
        handle.truncate(1 << 30)  # sparse: refused by its size, nothing read
    with pytest.raises(ValueError, match=r"has 1073741824 bytes, more than the 1048576 allowed"):
        read_yaml_file(huge)


def test_model_config_yaml_round_trips_through_the_strict_loader(tmp_path):
    from latentmoe_lab.yaml_loader import dump_yaml, parse_yaml

    shared = [1, 2]
    assert "&" not in dump_yaml({"a": shared, "b": shared})  # safe_dump would write an anchor and an alias
    assert parse_yaml(dump_yaml({"a": shared, "b": shared, "c": "010", "d": "yes", "e": 1e-6})) == \
        {"a": [1, 2], "b": [1, 2], "c": "010", "d": "yes", "e": 1e-6}
    cfg = ModelConfig.from_preset("tiny")
    cfg.to_yaml(tmp_path / "c.yaml")
    assert ModelConfig.from_yaml_file(tmp_path / "c.yaml") == cfg
    (tmp_path / "bad.yaml").write_text(cfg.to_yaml().replace("hidden_size: 64", "hidden_size: 64\nhidden_size: 32"))
    with pytest.raises(ValueError, match=r"bad\.yaml, line \d+, column 1: duplicate key 'hidden_size'"):
        ModelConfig.from_yaml_file(tmp_path / "bad.yaml")
    (tmp_path / "typed.yaml").write_text(cfg.to_yaml().replace("hidden_size: 64", "hidden_size: 0x40"))
    with pytest.raises(TypeError, match=r"typed\.yaml: hidden_size: expected int, got '0x40'"):
        ModelConfig.from_yaml_file(tmp_path / "typed.yaml")


def test_the_libyaml_path_reads_and_refuses_as_the_pure_python_reference():
    from latentmoe_lab.yaml_loader import parse_yaml

    texts = [(CONFIG_DIR / name).read_text() for name in sorted(os.listdir(CONFIG_DIR)) if name.endswith(".yaml")]
    texts += [ModelConfig.from_preset("tiny").to_yaml(), "a: [1, 2.5, -3, .inf, null, true, 'x', \"y\"]\n",
              "a: |\n  two\n  lines\n", "{a: {b: [c, {d: e}]}}", "a: 1:04\nb: 0x40\nc: yes\n", "? a\n: 1\n",
              "a: &x 1\n", "a: *x\n", "a: !!str 1\n", "a: 1\na: 2\n", "1: a\n", "a: [1\n", "a:\n\tb: 1\n",
              "a: 1\n---\nb: 2\n", "a: " + "[" * 40 + "]" * 40, "a: " + "9" * 40, "", "a: \x07\n", "- 1\n- 2\n"]
    for text in texts:
        outcomes = []
        for reference in (False, True):
            try:
                outcomes.append(("data", parse_yaml(text, "f", reference=reference)))
            except ValueError as error:  # the position and the rule; YAML syntax errors are worded differently
                message = str(error)
                outcomes.append(("error", message.split(": not valid YAML")[0] if "not valid YAML" in message
                                 else message))
        assert outcomes[0] == outcomes[1], text[:80]
