"""Reliability on one process (no process group): bad inputs refused up front with their
message, crash-consistent checkpoints (torn / missing / mixed files -> the last committed one),
finished-run detection, config-mismatch refusal, the NaN policy, and a resumed run whose
per-step losses are bit-identical to an uninterrupted one."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

from dcparallel import checkpoint
from dcparallel.apps.train_config import Config
from dcparallel.cost.schema import Profile
from dcparallel.data.sizes import check_step_budget
from dcparallel.profile.config import ProfilerConfig
from dcparallel.scenarios import read_lengths
from tests.faults import Fault, parse_faults, run  # dcparallel train's run + DCPARALLEL_FAULT
from tests.support import one_entry_profile_json

# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "section,key,value,message",
    [
        ("train", "lr", "fast", "[train] lr = 'fast' must be a number, not a string (e.g. lr = 0.003)"),
        (
            "model",
            "num_layers",
            4.5,
            "[model] num_layers = 4.5 must be an integer, not a fraction (e.g. num_layers = 4)",
        ),
        ("train", "max_steps", -3, "[train] max_steps = -3 must be >= 0"),
        ("model", "num_layers", 0, "[model] num_layers = 0 must be >= 1"),
        ("train", "policy", "fastest", "[train] policy: unknown policy 'fastest'; choose one of dcp, bucket, packed"),
        ("train", "nan_policy", "ignore", "[train] nan_policy = 'ignore' is not one of 'stop', 'skip'"),
        ("train", "resume_anyway", "yes", "[train] resume_anyway = 'yes' must be true or false"),
        ("train", "lr", float("nan"), "[train] lr = nan must be a finite number"),
        ("train", "lr", 0, "[train] lr = 0 must be > 0"),
        (
            "train",
            "shard_size",
            "big",
            "[train] shard_size = 'big' must be a positive integer (1, 2, 4, ...) or \"auto\"",
        ),
        ("train", "shard_size", 0, "[train] shard_size = 0 must be a positive integer"),
    ],
)
def test_config_wrong_type_or_range_is_named_with_the_fix(tmp_path, section, key, value, message):
    with pytest.raises(ValueError) as e:
        Config.from_dict({section: {key: value}}, "run.toml")
    assert message in str(e.value) and str(e.value).startswith("run.toml: ")


def test_config_unknown_keys_sections_and_model_mismatch(tmp_path):
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['num_layer'\] in \[model\].*did you mean 'num_layers'"):
        Config.from_dict({"model": {"num_layer": 2}})
    with pytest.raises(ValueError, match=r"unknown section\(s\) \['trian'\]"):
        Config.from_dict({"trian": {}})
    with pytest.raises(ValueError, match="hidden = 100 is not a multiple of num_heads = 8; pick num_heads dividing"):
        Config.from_dict({"model": {"hidden": 100, "num_heads": 8}})
    p = tmp_path / "bad.toml"
    p.write_text("[train]\nlr = \n")
    with pytest.raises(ValueError, match="cannot read the config"):
        Config.load(p)
    assert Config.from_dict({"train": {"lr": 1}}).train.lr == 1.0  # an integer is a fine float
    assert Config.from_dict({"train": {"shard_size": "auto"}}).train.shard_size == "auto"
    assert Config.from_dict({"train": {"shard_size": 2}}).train.shard_size == 2


def test_fault_spec_is_checked():
    assert parse_faults("exit@3:1, hang@5:0:2") == [Fault("exit", 3, 1, 0), Fault("hang", 5, 0, 2)]
    with pytest.raises(ValueError, match=r"DCPARALLEL_FAULT: bad item 'crash@3:1'; write KIND@STEP:RANK"):
        parse_faults("crash@3:1")
    with pytest.raises(ValueError, match="bad item 'exit@0:1'"):
        parse_faults("exit@0:1")


# ---------------------------------------------------------------- lengths, budget, profiles


@pytest.mark.parametrize(
    "text,message",
    [
        ("# nothing\n\n", "holds no samples"),
        ("12\nabc\n", ":2: expected integers, got 'abc'"),
        ("12\n0\n", ":2: sample 1: a text size is a positive integer token count; got 0"),
        ("12\n3.5\n", ":2: sample 1: a text size is a positive integer"),
        ("12\n1 2\n", ":2: a line is `tokens` or `frames height width`"),
        ("12\nnan\n", ":2: sample 1: a text size"),
    ],
)
def test_lengths_file_errors_name_file_and_line(tmp_path, text, message):
    p = tmp_path / "l.txt"
    p.write_text(text)
    with pytest.raises(ValueError) as e:
        read_lengths(p)
    assert message in str(e.value) and str(p) in str(e.value)


@pytest.mark.parametrize(
    "arr,message",
    [
        (np.zeros(0), "the lengths array is empty"),
        (np.array(["a", "b"]), "holds <U1 values, not numbers"),
        (np.ones((3, 2)), "has shape (n,) or (n, 3); got (3, 2)"),
        (np.array([5, -1]), "[1]: sample 1: a text size is a positive integer"),
    ],
)
def test_lengths_array_errors(tmp_path, arr, message):
    p = tmp_path / "l.npy"
    np.save(p, arr)
    with pytest.raises(ValueError) as e:
        read_lengths(p)
    assert message in str(e.value)


def test_step_budget_is_checked_before_profiling(tmp_path):
    with pytest.raises(ValueError, match="tokens_per_step must be a positive integer; got -5"):
        check_step_budget(-5, None)
    with pytest.raises(ValueError, match="give exactly one of tokens_per_step or samples_per_step"):
        check_step_budget(None, None)
    from dcparallel.api import DataCentricParallel
    from tests.support import make_model

    model = make_model("llama")
    dc = DataCentricParallel(model, layers=model.layers)
    with pytest.raises(ValueError, match="tokens_per_step must be a positive integer; got 0"):
        dc.prepare(list(range(4)), lengths=[8] * 4, tokens_per_step=0, profile_path=tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()  # refused before any profiling


def test_prepare_with_the_analytic_cost_profiles_nothing(tmp_path):
    from dcparallel.api import DataCentricParallel
    from dcparallel.cost.analytic import AnalyticCost
    from tests.support import make_model

    model = make_model("llama")
    dc = DataCentricParallel(model, layers=model.layers)
    data, path = [torch.arange(8)] * 6, tmp_path / "p.json"
    with pytest.raises(ValueError, match="cost='fast': give 'profiled' .* or 'analytic'"):
        dc.prepare(data, lengths=[8] * 6, tokens_per_step=16, cost="fast")
    with pytest.raises(ValueError, match="profiler_config is for cost='profiled'"):
        dc.prepare(data, lengths=[8] * 6, tokens_per_step=16, cost="analytic", profiler_config={"max_repeats": 1})
    loader = dc.prepare(data, lengths=[8] * 6, tokens_per_step=16, cost="analytic", profile_path=path)
    assert loader is dc.loader and isinstance(dc.cost, AnalyticCost) and loader.context.cost is dc.cost
    assert dc.profile is None and not path.exists() and len(loader) == 3


def _profile_json() -> dict:
    from dcparallel.spec import llama_like

    m = llama_like("m", num_layers=2, hidden=64, num_heads=4, ffn_hidden=128, vocab_size=64)
    return one_entry_profile_json(m)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("time_s", -0.5, "has time_s = -0.5; times and memory must be finite and >= 0"),
        ("time_s", float("nan"), "has time_s = nan"),
        ("memory_bytes", None, "is feasible but has no memory_bytes"),
    ],
)
def test_profile_with_negative_nan_or_missing_entries_is_refused(field, value, message):
    d = _profile_json()
    d["entries"][0][field] = value
    with pytest.raises(ValueError, match="is corrupt") as e:
        Profile.from_json(d)
    assert message in str(e.value)


def test_profile_with_a_bucket_without_entries_is_refused():
    d = _profile_json()
    d["entries"] = []
    with pytest.raises(ValueError, match=r"bucket\(s\) \['t64'\] have no entries"):
        Profile.from_json(d)


def test_sizes_far_beyond_the_profile_warn_with_the_range(caplog):
    from dcparallel.cost.profiled import ProfiledCost
    from dcparallel.spec import ClusterSpec

    cost = ProfiledCost(Profile.from_json(_profile_json()), ClusterSpec(world_size=1, gpus_per_node=1))
    with caplog.at_level(logging.WARNING, logger="dcparallel.cost.profiled"):
        cost.terms((100,), 1)
        assert not caplog.records  # within 2x of the range: interpolation, no warning
        cost.terms((5000,), 1)
    assert "5000 tokens is far beyond the profiled range 64..64 tokens" in caplog.text


# ---------------------------------------------------------------- training runs (analytic cost, world 1)


def _cfg(tmp_path, **train) -> Config:
    t = {"tokens_per_step": 1500, "max_steps": 5, "out_dir": str(tmp_path / "run"), "checkpoint_every": 2, **train}
    return Config.from_dict(
        {
            "model": {"num_layers": 2, "hidden": 32, "num_heads": 2, "ffn_hidden": 64},
            "data": {"num_samples": 30},
            "train": t,
            "profile": {"cost": "analytic"},
        }
    )


def _metrics(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 5-step run."""
    tmp = tmp_path_factory.mktemp("ref")
    assert run(_cfg(tmp)) == 0
    return _metrics(tmp / "run")


def test_resumed_run_is_bit_identical_and_a_finished_run_says_so(tmp_path, reference, caplog, monkeypatch):
    out = tmp_path / "run"
    # a crash during step 4 (a raise; a kill is tested under torchrun): step 3 is replayed from step 2
    monkeypatch.setenv("DCPARALLEL_FAULT", "raise@4:0")
    with pytest.raises(RuntimeError, match="injected fault: raise at step 4"):
        run(_cfg(tmp_path))
    assert [m["global_step"] for m in _metrics(out)] == [1, 2, 3]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the fault was for attempt 0
    with caplog.at_level(logging.WARNING, logger="dcparallel.train"):
        assert run(_cfg(tmp_path)) == 0
    assert "at step 2 (world size 1 -> 1; 1 step(s) after it replayed)" in caplog.text
    got = _metrics(out)
    assert [m["global_step"] for m in got] == [1, 2, 3, 4, 5]
    assert [m["loss"] for m in got] == [m["loss"] for m in reference]  # bit-identical, not approximately
    assert [m["sample_ids"] for m in got] == [m["sample_ids"] for m in reference]
    assert checkpoint.committed_steps(out / "checkpoint") == [5, 4]  # the final state, and keep = 2
    assert checkpoint.latest(out / "checkpoint").meta["finished"] is True

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dcparallel.train"):
        assert run(_cfg(tmp_path)) == 0
    assert "already finished: 5 of 5 steps done; nothing to do" in caplog.text
    assert len(_metrics(out)) == 5  # no duplicate lines


def test_config_mismatch_is_refused_with_the_difference_unless_resume_anyway(tmp_path, caplog):
    assert run(_cfg(tmp_path, max_steps=2)) == 0
    with pytest.raises(
        ValueError,
        match=r"written under another config: train.lr: checkpoint 0.003, now 0.01; "
        r"train.tokens_per_step: checkpoint 1500, now 1400",
    ):
        run(_cfg(tmp_path, max_steps=3, lr=0.01, tokens_per_step=1400))
    with caplog.at_level(logging.WARNING, logger="dcparallel.train"):
        assert run(_cfg(tmp_path, max_steps=3, lr=0.01, resume_anyway=True)) == 0
    assert "resuming" in caplog.text and "anyway" in caplog.text
    assert [m["global_step"] for m in _metrics(tmp_path / "run")] == [1, 2, 3]


def test_torn_missing_or_mixed_checkpoint_falls_back_to_the_last_committed(tmp_path, caplog):
    root = tmp_path / "run" / "checkpoint"
    assert run(_cfg(tmp_path, max_steps=4, keep_checkpoints=3)) == 0
    assert checkpoint.committed_steps(root) == [4, 2]
    f4, f2 = root / "step_00000004" / "__0_0.distcp", root / "step_00000002" / "__0_0.distcp"
    good = f4.read_bytes()
    f4.write_bytes(good[: len(good) // 2])  # torn
    with caplog.at_level(logging.WARNING, logger="dcparallel.checkpoint"):
        assert checkpoint.latest(root).step == 2
    assert "__0_0.distcp has" in caplog.text and "torn write" in caplog.text
    f4.write_bytes(f2.read_bytes())  # a file of another step in its place (same size or not)
    assert checkpoint.latest(root).step == 2
    f4.unlink()  # missing
    assert checkpoint.latest(root).step == 2
    (root / "step_00000006.tmp").mkdir()  # a save that crashed before its commit: ignored
    assert checkpoint.latest(root).step == 2
    # a resume uses step 2 and trains on to the end
    assert run(_cfg(tmp_path, max_steps=4, keep_checkpoints=3)) == 0
    assert [m["global_step"] for m in _metrics(tmp_path / "run")] == [1, 2, 3, 4]
    # nothing readable at all: an error saying so, not a silent fresh start
    for s in checkpoint.committed_steps(root):
        (root / f"step_{s:08d}" / checkpoint.MARKER).unlink()
    with pytest.raises(ValueError, match="holds no checkpoint every rank can read: .*no readable commit marker"):
        checkpoint.latest(root)


def test_checkpoints_load_weights_only(tmp_path):
    root = tmp_path / "ck"
    import torch.distributed.checkpoint as dcp

    def write(path):
        dcp.save({"x": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)

    checkpoint.save(root, 1, write, {"a": 1}, shard_size=1)
    ck = checkpoint.latest(root)
    assert ck.step == 1 and ck.meta == {"a": 1}
    torch.manual_seed(123)
    before = torch.rand(3)
    checkpoint.set_rng_state(ck.load_rng(0))
    torch.manual_seed(123)
    # a pickled object that is not a tensor / container is rejected by weights_only loading
    torch.save({"evil": Config()}, ck.path / "rng0.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        ck.load_rng(0)
    assert torch.equal(torch.rand(3), before)


def test_nan_policy_stop_and_skip(tmp_path, monkeypatch, reference):
    monkeypatch.setenv("DCPARALLEL_FAULT", "nan@2:0")
    with pytest.raises(FloatingPointError, match="step 2 .* has a non-finite loss nan; stopped"):
        run(_cfg(tmp_path / "stop"))
    assert run(_cfg(tmp_path / "skip", nan_policy="skip")) == 0
    got = _metrics(tmp_path / "skip" / "run")
    assert [m["skipped"] for m in got] == [False, True, False, False, False]
    assert got[1]["loss"] is None and got[0]["loss"] == reference[0]["loss"]
    # the skipped step changed nothing: step 3 sees the weights after step 1
    assert all(math.isfinite(m["loss"]) for m in got if not m["skipped"])
    assert got[2]["loss"] != reference[2]["loss"]
    events = [json.loads(x) for x in (tmp_path / "skip" / "run" / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "skip"] == [2]


def test_legacy_checkpoint_is_refused(tmp_path):
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "rank0.pt").write_bytes(b"old")
    with pytest.raises(ValueError, match="checkpoint of an older dcparallel"):
        run(_cfg(tmp_path))


def test_profile_cache_keeps_every_world_size(tmp_path):
    """A launch at world 1 next to a cached world-2 profile profiles once, keeps the world-2
    profile under its own name, and later finds its own copy again without profiling."""
    from dcparallel.profile.cache import load_or_profile, world_path

    class Stub:
        calls = 0
        config = ProfilerConfig(budget_s=None)

        def fingerprint(self):
            return {"world_size": 1}

        def run(self, sizes, journal_path=None):
            Stub.calls += 1
            return Profile.from_json({**_profile_json(), "fingerprint": {"world_size": 1}}), None

    path = tmp_path / "profile.json"
    (tmp_path / "profile.json").write_text(
        json.dumps({**_profile_json(), "world_size": 2, "fingerprint": {"world_size": 2}})
    )
    prof, _ = load_or_profile(path, Stub(), [64])
    assert Stub.calls == 1 and prof.world_size == 1
    assert Profile.load(world_path(path, 2)).world_size == 2  # not destroyed
    assert Profile.load(world_path(path, 1)).world_size == 1
    path.write_bytes(world_path(path, 2).read_bytes())  # a world-2 launch came back in between
    prof, stats = load_or_profile(path, Stub(), [64])
    assert Stub.calls == 1 and stats is None and prof.world_size == 1  # its own copy, reused


def test_oversize_sample_is_refused_before_profiling_in_train_and_demo(tmp_path):
    lengths = tmp_path / "l.txt"
    lengths.write_text("100\n300000000\n")
    cfg = Config.from_dict({"data": {"lengths": str(lengths)}, "train": {"out_dir": str(tmp_path / "run")}})
    with pytest.raises(
        ValueError,
        match=r"sample 1 \(size 300000000, 300000000 tokens\) fits no layout: even at "
        r"SP=1 with full recomputation it needs .* GiB per rank",
    ):
        run(cfg)
    assert not (tmp_path / "run" / "profile.json").exists()
    from dcparallel.apps.demo import _check_fits

    with pytest.raises(ValueError, match=r"sample 1 \(size 300000000, 300000000 tokens\) fits no layout"):
        _check_fits([100, 300000000], 2)


def test_planning_an_epoch_can_show_progress(capsys):
    from dcparallel.cost.analytic import AnalyticCost
    from dcparallel.data.loader import DataCentricLoader
    from dcparallel.spec import ClusterSpec, llama_like

    spec = llama_like("m", num_layers=2, hidden=32, num_heads=2, ffn_hidden=64, vocab_size=64)
    cl = ClusterSpec(world_size=2, gpus_per_node=2, memory_bytes=2**30, intra_bw=1e10, inter_bw=1e10)
    ld = DataCentricLoader(
        list(range(50)),
        [20 + i for i in range(50)],
        cost=AnalyticCost(spec, cl),
        cluster=cl,
        tokens_per_step=300,
        rank=0,
        world_size=2,
    )
    assert [p.sample_ids for p in ld.plans(progress=True)] == [p.sample_ids for p in ld.plans()]
    assert "planning epoch 0 (dcp): 100%" in capsys.readouterr().err


def _as_per_rank(root, step: int, model: torch.nn.Module) -> None:
    """The committed checkpoint of ``step`` (world 1) rewritten as the per-rank folder dcparallel
    0.1 wrote for it (`tests.checkpoint_v1`): its tensors as one ZeRO-1 shard of the flat vector."""
    import shutil

    from dcparallel.runtime.sharded_checkpoint import read_state
    from tests.checkpoint_v1 import save_per_rank

    ck = checkpoint.verify(root, step)[0]
    state = read_state(ck.path)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    flat = {
        "master": torch.cat([state[f"model/{n}"].flatten() for n in names]),
        **{k: torch.cat([state[f"optim/{n}/{k}"].flatten() for n in names]) for k in ("exp_avg", "exp_avg_sq")},
    }
    numel = flat["master"].numel()
    optimizer = {"num_steps": int(state["optim/num_steps"][0]), "start": 0, "stop": numel, "numel": numel, **flat}
    payload = {"optimizer": optimizer, "rng": ck.load_rng(0), "model": {n: state[f"model/{n}"] for n in names}}
    meta = ck.meta
    shutil.rmtree(ck.path)
    save_per_rank(root, step, payload, meta, optimizer_range=(0, numel))


def test_a_per_rank_checkpoint_is_refused_then_converted_and_resumes_bit_identically(tmp_path, reference, capsys):
    """A run whose newest checkpoint is in dcparallel 0.1's per-rank format is refused with the
    command that converts it; `dcparallel convert-checkpoint` converts it in place, and the run
    resumes from it with losses bit-identical to an uninterrupted run."""
    from dcparallel.apps.cli import main
    from dcparallel.apps.presets import build_model

    root = tmp_path / "run" / "checkpoint"
    assert run(_cfg(tmp_path, max_steps=2)) == 0
    _as_per_rank(root, 2, build_model(_cfg(tmp_path).model, 0))
    with pytest.raises(
        ValueError, match=r"per-rank checkpoint format of dcparallel 0.1.*dcparallel convert-checkpoint"
    ):
        run(_cfg(tmp_path))
    config = tmp_path / "run.toml"
    config.write_text(
        f"[model]\nnum_layers = 2\nhidden = 32\nnum_heads = 2\nffn_hidden = 64\n[data]\nnum_samples = 30\n[train]\n"
        f'tokens_per_step = 1500\nmax_steps = 5\nout_dir = "{tmp_path / "run"}"\ncheckpoint_every = 2\n'
        f'[profile]\ncost = "analytic"\n'
    )
    assert main(["convert-checkpoint", "--config", str(config)]) == 0
    assert "converted steps [2]" in capsys.readouterr().out
    ck = checkpoint.latest(root)
    assert (ck.version, ck.step, ck.world_size) == (checkpoint.VERSION, 2, 1)
    assert run(_cfg(tmp_path)) == 0
    got = _metrics(tmp_path / "run")
    assert [m["global_step"] for m in got] == [1, 2, 3, 4, 5]
    assert [m["loss"] for m in got] == [m["loss"] for m in reference]  # bit-identical, not approximately


def test_per_rank_conversion_refuses_what_it_cannot_convert_exactly(tmp_path):
    """A torn per-rank folder is left as it is, with the reason; shards that leave part of the
    flat vector uncovered, and a model of another size, are refused; a whole folder is cut
    into the parameters' keys exactly."""
    from dcparallel.apps.checkpoint_convert import convert, flat_state, tensors
    from tests.checkpoint_v1 import save_per_rank

    model = torch.nn.Linear(3, 2)  # 8 trainable elements

    def shard(start, stop, numel=8):
        return {"start": start, "stop": stop, "numel": numel, "num_steps": 3}

    shards = [{**shard(0, 5), **{k: torch.ones(5) for k in ("master", "exp_avg", "exp_avg_sq")}}]
    with pytest.raises(ValueError, match=r"cover \[0, 5\) of 8 elements"):
        flat_state(shards)
    shards.append({**shard(6, 8), **{k: torch.ones(2) for k in ("master", "exp_avg", "exp_avg_sq")}})
    with pytest.raises(ValueError, match=r"leave elements \[5, 6\) of the flat vector uncovered"):
        flat_state(shards)
    whole = flat_state([{**shard(0, 9, 9), **{k: torch.ones(9) for k in ("master", "exp_avg", "exp_avg_sq")}}])
    with pytest.raises(ValueError, match="for 9 parameters but this model trains 8; convert with the config"):
        tensors(whole, model)

    root = tmp_path / "ck"
    flat = {k: torch.arange(8.0) for k in ("master", "exp_avg", "exp_avg_sq")}
    payload = {"optimizer": {**shard(0, 8), **flat}, "rng": checkpoint.rng_state(), "model": model.state_dict()}
    save_per_rank(root, 4, payload, {}, optimizer_range=(0, 8))
    f = root / "step_00000004" / "rank0.pt"
    f.write_bytes(f.read_bytes()[:-5])
    done, left = convert(root, model)
    assert done == [] and len(left) == 1 and "rank0.pt is missing, torn or not the committed file" in left[0]
    # whole again: each parameter gets its piece of the flat vector, in named_parameters order
    save_per_rank(root, 4, payload, {"a": 1}, optimizer_range=(0, 8))
    assert convert(root, model) == ([4], [])
    from dcparallel.runtime.sharded_checkpoint import read_state

    ck = checkpoint.latest(root)
    state = read_state(ck.path)
    assert (ck.version, ck.step, ck.world_size, ck.meta) == (checkpoint.VERSION, 4, 1, {"a": 1})
    assert torch.equal(state["model/weight"], torch.arange(6.0).view(2, 3))
    assert torch.equal(state["optim/bias/exp_avg_sq"], torch.tensor([6.0, 7.0]))
    assert int(state["optim/num_steps"][0]) == 3
