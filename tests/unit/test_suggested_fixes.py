"""Every fix an error or warning suggests works where it is suggested: the oversize error names
`dcparallel train`'s keys ([data] max_tokens, [data] skip_oversize) and the API's, and the
train config accepts them; a memory budget the model's own states exceed says so (not a
sample) and by how much; the profile's range warning names a packed bin as such; the data
readers' field names are TOML keys."""

from __future__ import annotations

import json
import logging

import pytest

from dcparallel.apps.train_config import Config
from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.profiled import ProfiledCost
from dcparallel.cost.schema import Profile
from dcparallel.plan.context import PlanContext
from dcparallel.plan.types import NoLayoutFits
from dcparallel.spec import ClusterSpec, Workload, llama_like
from tests.faults import run
from tests.support import one_entry_profile_json

TINY = llama_like("tiny", num_layers=2, hidden=64, num_heads=4, ffn_hidden=128, vocab_size=64)


def _cluster(memory_mib: float) -> ClusterSpec:
    return ClusterSpec(
        world_size=2, gpus_per_node=2, memory_bytes=int(memory_mib * 2**20), intra_bw=1e10, inter_bw=1e10
    )


def test_oversize_error_names_the_train_keys_and_the_api_argument():
    cl = _cluster(64)
    with pytest.raises(NoLayoutFits) as e:
        PlanContext(Workload(TINY, (100, 5_000_000)), AnalyticCost(TINY, cl), cl)
    msg = str(e.value)
    assert "sample 1 (size 5000000, 5000000 tokens) fits no layout" in msg
    assert "[data] max_tokens" in msg and "[data] skip_oversize = true" in msg and "skip_oversize=True" in msg
    assert "(model states " in msg and " more than the 64.0 MiB usable" in msg


def test_model_states_beyond_the_budget_blame_the_states_not_a_sample():
    cl = _cluster(0.5)
    states = AnalyticCost(TINY, cl).model_state_bytes()
    assert states > cl.memory_bytes
    with pytest.raises(
        NoLayoutFits,
        match=r"the model's own states \(parameters, gradients, optimizer shards\) "
        r"need [0-9.]+ MiB per rank, [0-9.]+ [KM]iB more than the 512 KiB "
        r"usable, before any sample",
    ) as e:
        PlanContext(Workload(TINY, (10, 20)), AnalyticCost(TINY, cl), cl, skip_oversize=True)
    assert "[train] memory_mib" in str(e.value) and "sample " not in str(e.value).split("before any")[0]


def test_train_config_accepts_the_suggested_keys_and_the_reader_field_names():
    cfg = Config.from_dict({"data": {"skip_oversize": True, "max_tokens": 512}})
    assert cfg.data.skip_oversize and cfg.data.max_tokens == 512
    # text / chat field, latents manifest columns
    assert Config.from_dict({"data": {"field": "content"}}).data.field == "content"
    video = Config.from_dict(
        {
            "model": {"family": "diffusers", "architecture": "WanTransformer3DModel"},
            "data": {"latents_column": "vae", "text_column": "t5"},
        }
    ).data
    assert (video.latents_column, video.text_column) == ("vae", "t5")
    with pytest.raises(
        ValueError,
        match=r"\[data\] field = 'content' names a text field; a latents manifest names "
        r"its files' columns with latents_column and text_column",
    ):
        Config.from_dict(
            {"model": {"family": "diffusers", "architecture": "WanTransformer3DModel"}, "data": {"field": "content"}}
        )


def test_train_skips_oversize_samples_with_the_suggested_key(tmp_path):
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(["120", "300000000", *["90"] * 20]) + "\n")
    out = tmp_path / "run"
    cfg = Config.from_dict(
        {
            "model": {"num_layers": 2, "hidden": 32, "num_heads": 2, "ffn_hidden": 64},
            "data": {"lengths": str(lengths), "skip_oversize": True},
            "train": {"tokens_per_step": 600, "max_steps": 2, "out_dir": str(out)},
            "profile": {"cost": "analytic"},
        }
    )
    assert run(cfg) == 0
    ran = [i for x in (out / "metrics.jsonl").read_text().splitlines() for i in json.loads(x)["sample_ids"]]
    assert ran and 1 not in ran


def _profile_json() -> dict:
    return one_entry_profile_json(TINY)


@pytest.mark.parametrize(
    "planned,what",
    [
        (
            (64, 60),
            "a packed bin of 5000 tokens (the packed layout: several samples in one sequence; "
            "the longest sample has 64)",
        ),
        ((64, 5000), "a sample of 5000 tokens"),
    ],
)
def test_range_warning_names_a_packed_bin_as_a_bin(planned, what, caplog):
    cl = ClusterSpec(world_size=1, gpus_per_node=1, memory_bytes=2**40)
    cost = ProfiledCost(Profile.from_json(_profile_json()), cl)
    PlanContext(Workload(TINY, planned), cost, cl)  # notes the workload's longest sample
    with caplog.at_level(logging.WARNING, logger="dcparallel.cost.profiled"):
        cost.terms((5000,), 1)
    assert f"{what} is far beyond the profiled range 64..64 tokens" in caplog.text
    assert "dcparallel profile --buckets" in caplog.text and "--lengths" not in caplog.text
    if "bin" in what:  # a dcp user meets it too: dcp plans the packed layout on steps of few samples
        assert "whether dcp, which also plans the packed layout" in caplog.text
