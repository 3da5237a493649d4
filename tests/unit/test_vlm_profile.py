"""`prepare` on a vision-language model prices both towers: the adapter's spec holds the
tower (`adapters.vlm_tower`), the profile measures it per patch bucket after the language
model (`profile.vision.profile_tower`) and keeps it in the cached file, and the profiled cost
model prices a sample's images, so a step's plan follows them. World 1, a tiny Qwen2.5-VL
built from its config."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

from dcparallel.adapters.base import count_params  # noqa: E402
from dcparallel.api import DataCentricParallel  # noqa: E402
from dcparallel.cost.profiled import ProfiledCost  # noqa: E402
from dcparallel.cost.schema import Profile  # noqa: E402
from dcparallel.plan.context import PlanContext  # noqa: E402
from dcparallel.plan.policies import make_planner  # noqa: E402
from dcparallel.plan.steps import form_steps  # noqa: E402
from dcparallel.sim.replay import simulate, step_seconds  # noqa: E402
from dcparallel.spec import VisionSize, Workload  # noqa: E402
from tests import vlm_families as vlmf  # noqa: E402

#: a short profile: one timed run per layout, micro-batches of one and two
QUICK = {"repeats": 1, "max_repeats": 1, "min_time_s": 0.0, "max_mbs": 2, "modes": ("none", "full")}


def test_the_adapter_spec_holds_the_tower_as_from_its_config():
    from dcparallel.adapters.vlm_tower import vision_tower

    model = vlmf.build("qwen2.5-vl")
    spec = DataCentricParallel(model, memory_bytes=2**30).spec
    visual = model.model.visual
    assert spec.vision is not None and spec.vision.trainable
    assert spec.vision.num_params == count_params([visual]) and spec.num_params == count_params([model])
    assert (spec.vision.num_layers, spec.vision.full_layers, spec.vision.window) == (2, 1, 16)  # window 8 px / 2 px
    assert spec.vision == vision_tower(model)
    frozen_model = vlmf.build("qwen2.5-vl")
    frozen = DataCentricParallel(frozen_model, memory_bytes=2**30, freeze_vision=True).spec
    assert frozen.vision == dataclasses.replace(spec.vision, trainable=False)
    # the frozen tower holds no gradient or optimizer state: the spec's model states leave it out
    merger = count_params([visual.merger])
    assert frozen.frozen_params == count_params([frozen_model], frozen=True) == spec.vision.num_params - merger > 0
    assert DataCentricParallel(vlmf.build("internvl"), memory_bytes=2**30).spec.vision is None  # tiles: no grid
    from dcparallel.profile.vision import check_tower_shards

    with pytest.raises(ValueError, match="parameters sharded in blocks of 2; use shard_size=1"):
        check_tower_shards(spec, 2)  # refused before anything is profiled
    check_tower_shards(spec, 1)


def test_prepare_measures_the_tower_and_plans_a_large_image_dearer(tmp_path, monkeypatch):
    data = vlmf.make_data(18, seed=2)
    lengths = [vlmf.size(s) for s in data.samples]
    assert any(isinstance(s, VisionSize) for s in lengths) and any(type(s) is int for s in lengths)
    path = tmp_path / "profile.json"
    dc = DataCentricParallel(vlmf.build("qwen2.5-vl"), memory_bytes=2**30)
    dc.prepare(data.samples, lengths=lengths, samples_per_step=6, profile_path=str(path), profiler_config=QUICK)
    table = dc.profile.vision
    assert table is not None and table.trainable and len(table.patches) >= 2
    assert dc.profile.model.vision == dc.spec.vision
    assert Profile.load(path).vision == table  # the cache keeps it
    cost = dc.cost
    assert isinstance(cost, ProfiledCost)
    big = VisionSize(200, (4096,))  # a 128 x 128-pixel image's patches on 200 tokens
    with_image, text = cost.terms([big], 1), cost.terms([200], 1)
    assert with_image.time_none > text.time_none and with_image.fixed_bytes > text.fixed_bytes
    # the plan of a step follows the image: priced higher than the same tokens without it
    seconds = {}
    for name, size in (("image", big), ("text", 200)):
        ctx = PlanContext(Workload(dc.spec, (size, 60, 60)), cost, dc.cluster_spec)
        steps = form_steps(ctx.tokens, seed=0, tokens_per_step=320)
        assert [sorted(s.sample_ids) for s in steps] == [[0, 1, 2]]
        plan = make_planner("dcp", ctx, steps, score=step_seconds(ctx)).plan(steps[0])
        seconds[name] = simulate([plan], ctx).total_time
    assert seconds["image"] > seconds["text"], seconds

    # a second launch reuses the cached profile, tower included: nothing is measured again
    def measured(*a, **k):
        raise AssertionError("the cached profile's tower was measured again")

    monkeypatch.setattr("dcparallel.profile.vision.measure_tower", measured)
    again = DataCentricParallel(vlmf.build("qwen2.5-vl"), memory_bytes=2**30)
    again.prepare(data.samples, lengths=lengths, samples_per_step=6, profile_path=str(path), profiler_config=QUICK)
    assert again.profile.vision == table
