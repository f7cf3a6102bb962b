"""Seeded fuzz of a tiny checkpoint's model.safetensors (header edits and byte damage).

Every mutation must end in one of two ways: a one-line ValueError that names the checkpoint, or a load
whose logits are bit-identical to the intact checkpoint's. No other exception (a traceback), no hang
(each load runs under a 20 s alarm), no load with other logits (silent wrong). Header edits are also
loaded with verify_checksums=False, so the header checks alone must hold; byte damage inside the data is
what only the checksum can see, so it is loaded with checksums on. Most loads go through
load_weights_into (the same checks as from_pretrained, without rebuilding the model); every 25th goes
through from_pretrained and accelerate.
"""
import json
import random
import signal
import struct
from collections import Counter

import pytest
import torch

from latentmoe_lab.checkpoint import load_weights_into
from latentmoe_lab.checkpoint_integrity import SAFETENSORS_DTYPES
from latentmoe_lab.model import LatentMoEForCausalLM

SEED = 20261202
MUTATIONS = 300
IDS = torch.arange(16).reshape(1, 16) * 11 % 512


def _mutate_header(header: dict, rng: random.Random) -> str:
    """Edit `header` in place; returns what was done."""
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    kind = rng.choice(["dtype", "shape", "offset", "swap", "swap-same-size", "drop", "rename", "metadata",
                       "entry-type", "extra-key", "duplicate-order"])
    if kind == "dtype":
        entry["dtype"] = rng.choice([*SAFETENSORS_DTYPES, "X9", 4, None])
    elif kind == "shape":
        entry["shape"] = rng.choice([entry["shape"][::-1], entry["shape"] + [1], [], [-1], ["2"],
                                     [d + rng.choice([-1, 1]) for d in entry["shape"]]])
    elif kind == "offset":
        begin, end = entry["data_offsets"]
        delta = rng.choice([-8, -4, -1, 1, 4, 8, 2**40, -(2**40)])
        entry["data_offsets"] = rng.choice([[begin + delta, end], [begin, end + delta], [begin + delta, end + delta],
                                            [end, begin], [begin], "0"])
    elif kind in ("swap", "swap-same-size"):
        same = [k for k in names if k != name and header[k]["shape"] == entry["shape"]]
        other = header[rng.choice(same if kind == "swap-same-size" and same else names)]
        entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
    elif kind == "drop":
        del header[name]
    elif kind == "rename":
        header[name + ".x"] = header.pop(name)
    elif kind == "metadata":
        header["__metadata__"] = rng.choice([{"format": "np"}, {"format": 1}, [], None, {}])
    elif kind == "entry-type":
        header[name] = rng.choice([[], "F32", None, 7])
    elif kind == "extra-key":
        entry["extra"] = 1
    else:  # the same entries, listed in another order than their data
        items = list(header.items())
        rng.shuffle(items)
        header.clear()
        header.update(items)
    return kind


def _mutate_bytes(raw: bytes, length: int, rng: random.Random) -> tuple[str, bytes]:
    kind = rng.choice(["length", "flip-header", "flip-data", "truncate", "append"])
    if kind == "length":
        value = rng.choice([0, 1, length - 1, length + 1, 2**62, 2**64 - 1, rng.randrange(2**32)])
        return kind, struct.pack("<Q", value) + raw[8:]
    if kind == "truncate":
        return kind, raw[:rng.randrange(len(raw))]
    if kind == "append":
        return kind, raw + rng.randbytes(rng.choice([1, 8, 4096]))
    low, high = (8, 8 + length) if kind == "flip-header" else (8 + length, len(raw))
    damaged = bytearray(raw)
    for _ in range(rng.choice([1, 4, 64])):
        damaged[rng.randrange(low, high)] ^= 1 << rng.randrange(8)
    return kind, bytes(damaged)


def _alarm(signum, frame):
    raise TimeoutError("hang")


def test_fuzzed_checkpoint_files_are_refused_or_load_identically(tmp_path, tiny_config):
    torch.manual_seed(0)
    model = LatentMoEForCausalLM(tiny_config).eval()
    path = model.save_pretrained(tmp_path / "c")
    weights = path / "model.safetensors"
    intact = weights.read_bytes()
    length = struct.unpack("<Q", intact[:8])[0]
    header = json.loads(intact[8:8 + length])
    reference = model(IDS).logits
    target = LatentMoEForCausalLM(tiny_config).eval()  # what load_weights_into fills
    state = {k: v.clone() for k, v in target.state_dict().items()}
    rng = random.Random(SEED)
    outcomes, failures = Counter(), []
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        for case in range(MUTATIONS):
            if rng.random() < 0.6:
                edited = json.loads(json.dumps(header))
                kind = "header-" + _mutate_header(edited, rng)
                text = json.dumps(edited, separators=(",", ":")).encode()
                raw = struct.pack("<Q", max(len(text), length)) + text.ljust(length) + intact[8 + length:]
                modes = (True, False)
            else:
                kind, raw = _mutate_bytes(intact, length, rng)
                modes = (True,)
            weights.write_bytes(raw)
            for verify in modes:
                signal.alarm(20)
                try:
                    if case % 25 == 0:
                        loaded = LatentMoEForCausalLM.from_pretrained(path, verify_checksums=verify)
                    else:
                        target.load_state_dict(state)
                        load_weights_into(target, path, verify_checksums=verify)
                        loaded = target
                    same = torch.equal(loaded(IDS).logits, reference)
                    outcome = "identical" if same else "silent-wrong"
                except ValueError as error:
                    outcome = "refused" if str(path) in str(error) and "\n" not in str(error) else "bad-message"
                except TimeoutError:
                    outcome = "hang"
                except Exception as error:  # noqa: BLE001 - a traceback is what this test counts
                    outcome = f"traceback {type(error).__name__}"
                finally:
                    signal.alarm(0)
                outcomes[outcome] += 1
                if outcome not in ("identical", "refused"):
                    failures.append((case, kind, verify, outcome))
    finally:
        signal.signal(signal.SIGALRM, previous)
        weights.write_bytes(intact)
    print(f"{MUTATIONS} mutations, {sum(outcomes.values())} loads: {dict(outcomes)}")
    assert not failures, f"{failures[:10]} ({outcomes})"
    assert outcomes["refused"] > 0.8 * sum(outcomes.values()), outcomes  # the fuzz really damages the file
    assert torch.equal(LatentMoEForCausalLM.from_pretrained(path)(IDS).logits, reference)  # restored: loads


@pytest.fixture(autouse=True)
def _no_stray_alarm():
    yield
    signal.alarm(0)
