"""The order in which `make test` hands test modules to its two pytest-xdist workers.

``--dist loadfile`` keeps a module on one worker (its gloo process pool is started once) and,
with ``--no-loadscope-reorder``, hands modules out in collection order, one to whichever worker
is nearly out of work. Started longest first, the long modules run while the short ones fill
the gaps, and the two workers end together; in xdist's default order (most tests first) the
torchrun tests, one or two tests each, came last and ran side by side while the other worker
had nothing left.

`MODULE_SECONDS`: each long module's seconds in `make test` from a fresh clone on 2 cores, its
tests' durations added up (benchmarks/test-time_cpu_2026-12-07.md). A module not listed counts
0 and keeps its collection place after the listed ones. Only the order depends on these numbers, never a result: refresh
them when a module's time changes by more than a few seconds."""

from __future__ import annotations

MODULE_SECONDS: dict[str, float] = {
    # gloo worker pools (world 2 and 4)
    "tests/dist/test_dist_sharded.py": 49,
    "tests/dist/test_dist_video_epoch.py": 47,
    "tests/dist/test_dist_adapters.py": 30,
    "tests/dist/test_dist_joint.py": 25,
    "tests/dist/test_dist_grad_sync.py": 25,
    "tests/dist/test_dist_vlm.py": 23,
    "tests/dist/test_dist_runtime.py": 15,
    "tests/dist/test_dist_ring.py": 14,
    "tests/dist/test_dist_profile_control.py": 14,
    "tests/dist/test_dist_elastic.py": 10,
    "tests/dist/test_dist_step_memory.py": 9,
    "tests/dist/test_dist_meta_init.py": 9,
    "tests/dist/test_dist_lora.py": 9,
    "tests/dist/test_dist_rl.py": 7,
    "tests/dist/test_dist_loader.py": 7,
    "tests/dist/test_dist_joint_epoch.py": 7,
    # torchrun launches
    "tests/e2e/test_restarts_torchrun.py": 31,
    "tests/e2e/test_finetune_torchrun.py": 30,
    "tests/e2e/test_device_check_dry_run.py": 29,
    "tests/e2e/test_multinode_torchrun.py": 27,
    "tests/e2e/test_train_torchrun.py": 20,
    # in the pytest process (and CLI subprocesses)
    "tests/unit/test_loader_properties.py": 36,
    "tests/unit/test_mixed_sizes.py": 18,
    "tests/unit/test_dcp_scale.py": 18,
    "tests/unit/test_loader_stop.py": 17,
    "tests/unit/test_dcp_mixes.py": 16,
    "tests/unit/test_dcp_expand.py": 16,
    "tests/unit/test_loader.py": 13,
    "tests/unit/test_hf_attention_keywords.py": 13,
    "tests/unit/test_scenarios.py": 11,
    "tests/unit/test_profile.py": 11,
    "tests/unit/test_policies.py": 11,
    "tests/unit/test_hf_trainer.py": 11,
    "tests/unit/test_golden_plans.py": 11,
    "tests/unit/test_rollout_reuse.py": 10,
    "tests/unit/test_reliability.py": 10,
    "tests/unit/test_mix_share.py": 10,
    "tests/unit/test_vlm_profile.py": 9,
    "tests/unit/test_sharded_plan.py": 9,
    "tests/unit/test_profile_bound.py": 9,
    "tests/unit/test_function_size.py": 8,
    "tests/unit/test_bounds.py": 8,
    "tests/unit/test_loader_lookahead.py": 7,
    "tests/unit/test_diffusers_adapters.py": 7,
    "tests/unit/test_dcp_sample.py": 7,
    "tests/unit/test_cost_batch.py": 7,
}


def longest_first(items: list) -> None:
    """Sorts ``items`` in place by their module's `MODULE_SECONDS`, longest first; a module's
    tests keep their order and stay together (the sort is stable)."""
    items.sort(key=lambda item: -MODULE_SECONDS.get(item.nodeid.split("::", 1)[0], 0.0))
