"""LoRA and frozen parameters in one process: PEFT models are driven as their base model and
other PEFT methods refused by name; the cost model and the profiler's state bytes count no
gradient or optimizer state for frozen parameters and less backward work; `simulate` plans
Wan 2.1 14B with LoRA on 8 GPUs of 72 GiB at shard size 1, where the full fine-tune needs 8.
Gloo parity of the training itself: tests/dist/test_dist_lora.py."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest
import torch

from dcparallel.cost.analytic import AnalyticCost
from dcparallel.cost.base import grad_sync_time, state_recipe
from dcparallel.cost.lora import with_lora
from dcparallel.profile.shards import state_bytes
from dcparallel.runtime.engine import Engine
from dcparallel.scenarios import model_preset
from dcparallel.spec import h200_cluster
from tests import adapter_models, lora_models

pytest.importorskip("peft")
torch.set_num_threads(1)


def test_peft_model_is_driven_as_its_base_model():
    model = lora_models.build("lora-llama")
    dc = Engine(model)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert dc.adapter.name == "llama-h64-l2" and dc.adapter.num_kv_heads == 2
    assert dc.numel == lora_models.adapter_numel(model) == 7168  # the gradient buffer: adapters only
    assert dc.adapter.spec.frozen_params == frozen
    assert dc.adapter.spec.num_params == sum(p.numel() for p in model.parameters())
    # frozen parameters stay out of the flat buffer: their storage is their own
    assert all(p.data_ptr() != dc.flat_param.data_ptr() for p in model.parameters() if not p.requires_grad)


@pytest.mark.parametrize(
    "kind,expect", [("prompt", "PROMPT_TUNING"), ("ia3", "IA3"), ("replicate", "layer_replication")]
)
def test_other_peft_methods_are_refused_by_name(kind, expect):
    from peft import IA3Config, LoraConfig, PromptTuningConfig, get_peft_model

    base = adapter_models.build("hf-llama")
    config = {
        "prompt": PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "ia3": IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
        "replicate": LoraConfig(r=2, target_modules=["q_proj"], layer_replication=[[0, 2], [1, 2]]),
    }[kind]
    model = get_peft_model(base, config)
    with pytest.raises(ValueError, match=expect):
        Engine(model)


def test_state_recipe_counts_no_gradient_or_optimizer_state_for_frozen_parameters():
    full = model_preset("wan-14b")
    lora = with_lora(full, 64)
    t, f = lora.trainable_params, lora.frozen_params
    assert f == full.num_params and 0.01 < t / full.num_params < 0.03  # rank 64: about 2% of 14B
    one = state_recipe(lora, 8, 1)
    assert one.params == 2 * (t + f) and one.grads == 4 * t and one.optimizer == 12 * t / 8
    two = state_recipe(lora, 8, 2)
    assert two.params == (4 * t + 2 * f) / 2 and two.grads == 4 * t / 2 and two.optimizer == 8 * t / 8
    assert state_recipe(full, 8, 1).grads == 4 * full.num_params
    cluster = h200_cluster(8)
    assert grad_sync_time(lora, cluster) < 0.03 * grad_sync_time(full, cluster)


def test_frozen_weights_skip_their_weight_gradient_in_the_analytic_cost():
    full = model_preset("wan-14b")
    frozen = dataclasses.replace(full, frozen_params=full.num_params - 1)  # everything frozen but one
    cluster = h200_cluster(8)
    size = (81, 480, 832)
    t_full = AnalyticCost(full, cluster).terms([size], 8).time_none
    t_frozen = AnalyticCost(frozen, cluster).terms([size], 8).time_none
    assert t_frozen < t_full  # the linear work is 2/3, attention unchanged
    assert t_frozen > 2 / 3 * t_full


def test_profiler_state_bytes_count_frozen_parameters_stored_only():
    model = lora_models.build("lora-llama")
    dc = Engine(model)
    total = sum(p.numel() for p in model.parameters())
    t = dc.numel
    # fp32, world 1: parameters 4 P, gradients 4 T, moments 8 T (the fp32 adapters are the master)
    assert state_bytes(dc, dc.adapter.spec, torch.device("cpu")) == 4 * total + 12 * t


def _simulate(*args: str) -> dict:
    from dcparallel.apps.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert (
            main(
                [
                    "simulate",
                    "--model",
                    "wan-14b",
                    "--world",
                    "8",
                    "--memory-gib",
                    "72",
                    "--shard-size",
                    "auto",
                    "--max-steps",
                    "1",
                    "--policy",
                    "dcp",
                    "--quiet",
                    "--json",
                    *args,
                ]
            )
            == 0
        )
    return json.loads(out.getvalue().strip().splitlines()[-1])


def test_simulate_plans_wan_14b_with_lora_on_8_gpus_at_shard_size_1():
    lora = _simulate("--lora-rank", "64")
    assert lora["model"] == "wan-14b-lora64" and lora["shard_size"] == 1 and lora["steps"] >= 1
    assert lora["peak_memory_bytes"] <= 72 * 2**30 and lora["model_state_bytes"] < 32 * 2**30
    full = _simulate()  # the full fine-tune needs its states sharded over the node
    assert full["shard_size"] == 8
