"""Commands for test_dist_elastic (module-level so spawned workers can import them)."""

from __future__ import annotations


def case_train(cfg: dict) -> int:
    from dcparallel.apps.train import run
    from dcparallel.apps.train_config import Config

    return run(Config.from_dict(cfg))


def case_reshard(cfg: dict, ckpt_dir: str) -> dict:
    """Loads every shard of a checkpoint into this world's ZeroAdamW; the unsharded state."""
    from dcparallel import checkpoint
    from dcparallel.api import DataCentricParallel
    from dcparallel.apps.presets import build_model
    from dcparallel.apps.train_config import Config

    c = Config.from_dict(cfg)
    model = build_model(c.model, c.train.seed)
    dc = DataCentricParallel(model, layers=model.layers, policy=c.train.policy, seed=c.train.seed)
    opt = dc.optimizer(lr=c.train.lr)
    ck = checkpoint.latest(ckpt_dir)
    opt.load_state_dict([ck.load(r)["optimizer"] for r in range(ck.world_size)])
    full = opt.full_state()
    return {"step": ck.step, "num_steps": opt.num_steps, "range": (opt.state_dict()["start"], opt.state_dict()["stop"]),
            **{k: v.clone() for k, v in full.items()}}
