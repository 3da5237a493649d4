"""The order in which `make test` hands test modules to its two pytest-xdist workers.

``--dist loadfile`` keeps a module on one worker (its gloo process pool is started once) and,
with ``--no-loadscope-reorder``, hands modules out in collection order, one to whichever worker
is nearly out of work. Started longest first, the long modules run while the short ones fill
the gaps, and the two workers end together; in xdist's default order (most tests first) the
torchrun tests, one or two tests each, came last and ran side by side while the other worker
had nothing left.

`MODULE_SECONDS`: each long module's seconds in `make test` on 2 cores: its CPU seconds, all
its processes and phases added up (benchmarks/test-time_cpu_2026-12-06.md), which is about its
wall time when the two workers share the two cores. A module not listed counts 0 and keeps its collection
place after the listed ones. Only the order depends on these numbers, never a result: refresh
them when a module's time changes by more than a few seconds."""

from __future__ import annotations

MODULE_SECONDS: dict[str, float] = {
    # gloo worker pools (world 2 and 4)
    "tests/dist/test_dist_adapters.py": 75,
    "tests/dist/test_dist_sharded.py": 90,
    "tests/dist/test_dist_video_epoch.py": 50,
    "tests/dist/test_dist_joint.py": 42,
    "tests/dist/test_dist_runtime.py": 21,
    "tests/dist/test_dist_joint_epoch.py": 16,
    "tests/dist/test_dist_vlm.py": 41,
    "tests/dist/test_dist_hf_families.py": 8,
    "tests/dist/test_dist_hf_structure.py": 10,
    "tests/dist/test_dist_ring.py": 27,
    "tests/dist/test_dist_grad_sync.py": 26,
    "tests/dist/test_dist_rl.py": 8,
    "tests/dist/test_dist_diffusers_memory.py": 25,
    "tests/dist/test_dist_lora.py": 11,
    "tests/dist/test_dist_elastic.py": 15,
    "tests/dist/test_dist_loader.py": 15,
    "tests/dist/test_dist_mixed_sizes.py": 10,
    "tests/dist/test_dist_profile.py": 10,
    # torchrun launches
    "tests/e2e/test_restarts_torchrun.py": 54,
    "tests/e2e/test_finetune_torchrun.py": 43,
    "tests/e2e/test_train_torchrun.py": 40,
    "tests/e2e/test_multinode_torchrun.py": 27,
    "tests/e2e/test_profile_torchrun.py": 12,
    "tests/e2e/test_oom_torchrun.py": 15,
    "tests/e2e/test_device_check_dry_run.py": 66,
    # in the pytest process (and CLI subprocesses)
    "tests/unit/test_hf_attention_keywords.py": 16,
    "tests/unit/test_loader_properties.py": 26,
    "tests/unit/test_dcp_expand.py": 10,
    "tests/unit/test_profile.py": 23,
    "tests/unit/test_reliability.py": 25,  # a dozen short `dcparallel train` runs at world 1
    "tests/unit/test_dcp_mixes.py": 20,
    "tests/unit/test_scenarios.py": 19,
    "tests/unit/test_loader_stop.py": 20,  # planners busy for a minute, stopped; a killed run
    "tests/unit/test_train_dtype.py": 17,  # diffusers and transformers models built five ways
    "tests/unit/test_train_workers.py": 15,  # a spawned DataLoader worker imports torch
    "tests/unit/test_loader.py": 15,
    "tests/unit/test_vision_sizes.py": 14,  # imports transformers' image processors
    "tests/unit/test_vlm.py": 15,  # Qwen2.5-VL built and imported in the pytest process
    "tests/unit/test_vlm_profile.py": 15,  # a tiny Qwen2.5-VL profiled, tower included, at world 1
    "tests/unit/test_mixed_sizes.py": 13,
    "tests/unit/test_dcp_scale.py": 12,
    "tests/unit/test_mix_share.py": 12,
    "tests/unit/test_rollout_reuse.py": 12,  # RL steps planned twice each, 1024 simulated GPUs
    "tests/unit/test_dcp_static.py": 10,
    "tests/unit/test_loader_lookahead.py": 14,  # training steps slept through, a planning process
    "tests/unit/test_mixes.py": 10,
    "tests/unit/test_shape_bound.py": 10,
    "tests/unit/test_sharded_plan.py": 11,
    "tests/unit/test_resume_schedule.py": 12,  # four short `dcparallel train` runs, world 1
    "tests/unit/test_hf_trainer.py": 11,  # eleven short Trainer runs, world 1
    "tests/unit/test_trl_sft.py": 20,  # TRL imported, three short SFTTrainer runs
}


def longest_first(items: list) -> None:
    """Sorts ``items`` in place by their module's `MODULE_SECONDS`, longest first; a module's
    tests keep their order and stay together (the sort is stable)."""
    items.sort(key=lambda item: -MODULE_SECONDS.get(item.nodeid.split("::", 1)[0], 0.0))
