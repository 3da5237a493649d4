"""Commands for test_dist_elastic (module-level so spawned workers can import them)."""

from __future__ import annotations


def case_train(cfg: dict) -> int:
    from dcparallel.apps.train import run
    from dcparallel.apps.train_config import Config

    return run(Config.from_dict(cfg))


def case_reshard(cfg: dict, ckpt_dir: str) -> dict:
    """Loads the newest checkpoint into this world's ZeroAdamW; the unsharded state and the
    trainable parameters' names in the order of the flat vector."""
    from dcparallel import checkpoint
    from dcparallel.api import DataCentricParallel
    from dcparallel.apps.presets import build_model
    from dcparallel.apps.train_config import Config
    from dcparallel.runtime import sharded_checkpoint

    c = Config.from_dict(cfg)
    model = build_model(c.model, c.train.seed)
    dc = DataCentricParallel(model, layers=model.layers, policy=c.train.policy, seed=c.train.seed)
    opt = dc.optimizer(lr=c.train.lr)
    ck = checkpoint.latest(ckpt_dir)
    sharded_checkpoint.load(ck.path, dc.engine, opt)
    full = opt.full_state()
    return {
        "step": ck.step,
        "num_steps": opt.num_steps,
        "range": (opt.state_dict()["start"], opt.state_dict()["stop"]),
        "names": [n for n, p in model.named_parameters() if p.requires_grad],
        **{k: v.clone() for k, v in full.items()},
    }
