"""`dcparallel simulate` for users: the three user policies by default (the research ones with
--all), columns named in words, each policy's layout said plainly, a line under the table on
dcp against the best static layout and why, and a --profile's own world as the default."""

from __future__ import annotations

import json

import pytest

from dcparallel.apps.cli import main
from dcparallel.cost.schema import Profile
from dcparallel.spec import llama_like


@pytest.fixture
def args(tmp_path) -> list[str]:
    """An epoch of 240 documents of 1k-131k tokens (a skewed text corpus) on 8 GPUs."""
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(str(1024 * (1 + (i * 37) % 128 if i % 8 == 0 else 1 + i % 8)) for i in range(240)))
    return ["simulate", "--lengths", str(lengths), "--world", "8", "--tokens-per-step", str(2**20), "--quiet"]


def test_default_is_the_user_policies_and_all_adds_the_research_ones(args, capsys):
    assert main([*args, "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)["policies"]) == ["bucket", "packed", "dcp"]
    assert main([*args, "--json", "--all"]) == 0
    assert {"dcp-intra", "dcp-inter", "dcp-inter-pac"} <= set(json.loads(capsys.readouterr().out)["policies"])


def test_table_speaks_in_words_with_a_verdict_line(args, capsys):
    assert main(args) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("policy"))
    for column in (
        "vs bucket",
        "tokens/s",
        "step time s",
        "ranks idle",
        "of lower bound",
        "planning ms/step",
        "peak memory",
        "layout",
    ):
        assert column in header, column
    assert "bound_eff" not in text and "{'sp'" not in text and "settings" not in header
    assert "for every sample, recompute" in text  # a static layout, in words
    verdict = next(line for line in text.splitlines() if line.startswith("dcp: "))
    assert "the best static layout here (" in verdict and "its tokens ran at SP " in verdict
    assert "x faster than" in verdict or "not faster than" in verdict


def test_a_profile_gives_its_own_world_by_default(tmp_path, capsys):
    m = llama_like("m", num_layers=2, hidden=64, num_heads=4, ffn_hidden=128, vocab_size=64)
    e = {"bucket": "t64", "sp": 1, "mbs": 1, "recompute": "none", "time_s": 0.01, "memory_bytes": 1e6, "feasible": True}
    Profile(
        fingerprint={},
        model=m,
        world_size=1,
        gpus_per_node=1,
        model_state_bytes=1e6,
        grad_sync_s=0.0,
        buckets=[{"key": "t64", "size": 64, "tokens": 64}],
        entries=[e],
    ).save(tmp_path / "p.json")
    lengths = tmp_path / "l.txt"
    lengths.write_text("40\n64\n30\n")
    assert (
        main(
            [
                "simulate",
                "--profile",
                str(tmp_path / "p.json"),
                "--lengths",
                str(lengths),
                "--tokens-per-step",
                "100",
                "--json",
                "--quiet",
            ]
        )
        == 0
    )  # no --world: the profile's
    out = json.loads(capsys.readouterr().out)
    assert (out["world"], out["gpus_per_node"]) == (1, 1)
