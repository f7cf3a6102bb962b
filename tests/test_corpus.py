"""The standard-library corpus: files, held-out split by name hash, packing, the batch order."""
import sysconfig

import pytest
import torch

from latentmoe_lab.tokenizer import ByteTokenizer
from latentmoe_lab.training.corpus import Corpus, batch_rows, encode, is_held_out, load_corpus, pack, source_files


@pytest.fixture
def tree(tmp_path):
    """60 small modules, one in site-packages (excluded), one non-Python file (excluded)."""
    for i in range(60):
        (tmp_path / f"pkg{i % 3}").mkdir(exist_ok=True)
        (tmp_path / f"pkg{i % 3}" / f"mod{i}.py").write_text(f"def f{i}():\n    return {i}\n")
    (tmp_path / "site-packages" / "third").mkdir(parents=True)
    (tmp_path / "site-packages" / "third" / "x.py").write_text("import third\n")
    (tmp_path / "notes.txt").write_text("not python")
    (tmp_path / "pkg0" / "latin.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8
    return tmp_path


def test_files_split_and_tokens(tree, capsys):
    corpus = load_corpus(tree, held_out_fraction=0.2)
    names = corpus.train_files + corpus.held_out_files
    assert len(names) == 61 and not any("site-packages" in n for n in names) and "notes.txt" not in names
    assert set(corpus.held_out_files) == {n for n in names if is_held_out(n, 0.2)}
    assert corpus.train.dtype == torch.uint8
    text = bytes(corpus.train.tolist()).decode("utf-8")
    assert text.startswith("# file: pkg0/latin.py\ns = '\ufffd'\n")  # sorted by path; bad bytes replaced
    out = capsys.readouterr().out
    assert "61 files" in out and f"{corpus.train.numel() + corpus.held_out.numel():,} bytes" in out


def test_deterministic_and_independent_of_listing_order(tree, tmp_path_factory):
    first, second = load_corpus(tree, 0.2, verbose=False), load_corpus(tree, 0.2, verbose=False)
    assert torch.equal(first.train, second.train) and first.held_out_files == second.held_out_files
    # the same names created in reverse order land in the same split
    other = tmp_path_factory.mktemp("reversed")
    for name in reversed(first.train_files + first.held_out_files):
        (other / name).parent.mkdir(parents=True, exist_ok=True)
        (other / name).write_bytes((tree / name).read_bytes())
    third = load_corpus(other, 0.2, verbose=False)
    assert third.held_out_files == first.held_out_files and torch.equal(third.held_out, first.held_out)


def test_held_out_fraction_is_about_two_percent():
    share = sum(is_held_out(f"lib/module_{i}.py", 0.02) for i in range(20000)) / 20000
    assert 0.015 < share < 0.025


def test_the_running_interpreters_stdlib(capsys):
    files = source_files(__import__("pathlib").Path(sysconfig.get_paths()["stdlib"]))
    assert len(files) > 100 and all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    corpus = load_corpus()
    assert 0.005 < corpus.held_out.numel() / (corpus.train.numel() + corpus.held_out.numel()) < 0.05
    assert "os.py" in corpus.train_files + corpus.held_out_files
    assert f"(sha256 {corpus.digest()})" in capsys.readouterr().out
    held_out_changed = Corpus(corpus.root, corpus.train, corpus.held_out.clone().fill_(32), corpus.train_files,
                              corpus.held_out_files)
    assert len(corpus.digest()) == 12 and held_out_changed.digest() != corpus.digest()


def test_pack_and_batch_rows():
    rows = pack(torch.arange(23, dtype=torch.uint8), 5)
    assert rows.shape == (4, 5) and rows[1].tolist() == [5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="seq_len"):
        pack(torch.arange(3), 5)
    # one pass visits every row once; ranks split the global batch in order
    seen = torch.cat([batch_rows(step, 4, 12, seed=3) for step in range(3)])
    assert sorted(seen.tolist()) == list(range(12))
    assert torch.equal(batch_rows(5, 4, 12, 3), batch_rows(5, 4, 12, 3))
    halves = torch.cat([batch_rows(5, 4, 12, 3, rank=r, world=2) for r in range(2)])
    assert torch.equal(halves, batch_rows(5, 4, 12, 3))
    assert not torch.equal(torch.cat([batch_rows(s, 4, 12, 3) for s in range(3, 6)]), seen)  # a new order per pass
    with pytest.raises(ValueError, match="divisible"):
        batch_rows(0, 5, 12, 0, rank=0, world=2)


def test_encode_gives_the_byte_tokenizers_ids():
    text = "def f(x):\n    return 'é' + \"\u2603\"  # ünïcode\n"
    assert torch.equal(encode(text).long(), ByteTokenizer(512).encode(text)[0])
