"""`dcparallel train --check`: the config, its lengths file and its dataset checked in one
process, without torchrun (nothing distributed starts); an error is one line on stderr,
ending with a newline, and the summary names what the run will train on. A text corpus whose
field is not "text" is named by [data] field."""

from __future__ import annotations

import pytest
import torch

from dcparallel.apps.cli import main
from dcparallel.apps.train_config import Config
from tests.train_fixtures import WORDS, tokenizer, write_config, write_jsonl


def test_check_accepts_a_good_config_without_starting_torch_distributed(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("10\n200\n35\n")
    cfg = write_config(tmp_path / "run.toml", data={"lengths": str(lengths)}, train={"out_dir": str(tmp_path / "o")})
    assert main(["train", "--check", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "config OK" in out and "3 samples of 10-200 tokens" in out and "torchrun --nproc-per-node" in out
    assert not torch.distributed.is_initialized() and not (tmp_path / "o").exists()


def test_check_reports_a_bad_lengths_line_as_one_line_with_a_newline(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("10\nabc\n")
    cfg = write_config(tmp_path / "run.toml", data={"lengths": str(lengths)})
    assert main(["train", "--check", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.endswith("\n") and "l.txt" in err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model directory as --check reads it: the config and the tokenizer (no weights)."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("m")
    transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("field,ok", [(None, False), ("content", True)])
def test_check_reads_a_corpus_under_another_field_named_by_data_field(tmp_path, capsys, model_dir, field, ok):
    model = model_dir
    rows = [{"content": " ".join(WORDS[: 3 + i])} for i in range(5)]
    data = {"path": str(write_jsonl(tmp_path / "code.jsonl", rows)), **({"field": field} if field else {})}
    cfg = write_config(tmp_path / "run.toml", model={"pretrained": str(model)}, data=data)
    assert main(["train", "--check", "--config", str(cfg)]) == (0 if ok else 2)
    got = capsys.readouterr()
    if ok:
        assert "5 samples of 4-8 tokens" in got.out  # with <s> and </s>
    else:
        assert (
            "no row has the field 'text' (the first row's fields: ['content']); name the field: [data] field" in got.err
            and "skip_bad" not in got.err
        )  # skipping every row would be no fix


def test_check_takes_the_ring_key_and_refuses_a_non_boolean(tmp_path, capsys):
    """``[train] ring = true`` is a run's way to `DataCentricParallel(ring=True)`; a value that
    is not a boolean is refused, naming the key and value."""
    lengths = tmp_path / "l.txt"
    lengths.write_text("10\n200\n")
    cfg = write_config(tmp_path / "run.toml", data={"lengths": str(lengths)}, train={"ring": True})
    assert main(["train", "--check", "--config", str(cfg)]) == 0
    assert Config.load(cfg).train.ring is True
    bad = write_config(tmp_path / "bad.toml", data={"lengths": str(lengths)}, train={"ring": "yes"})
    assert main(["train", "--check", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "[train] ring = 'yes' must be true or false" in err, err
