"""The user-facing object: `DataCentricParallel`, the ten lines a training loop adds.

    dc = dcparallel.DataCentricParallel(model, policy="dcp")   # finds the model's adapter
    loader = dc.prepare(dataset, lengths=dataset.lengths, tokens_per_step=2**20, loss_fn=loss_fn)
    opt = dc.optimizer(lr=3e-4)                                 # AdamW, torch's defaults
    for step in loader:
        for batch in step:
            with dc.micro_batch(batch) as ctx:
                ctx.backward(loss_fn(model, batch, ctx))         # e.g. ctx.lm_loss(model(...).logits)
        dc.sync_gradients()
        dc.clip_grad_norm_(1.0)                                  # optional
        opt.step()

`prepare` profiles the model at the launch's world size (or reuses a matching cached
profile; ``cost="analytic"`` prices from the analytic cost model instead), then returns the
`DataCentricLoader` that plans every step with the policy. The steps themselves run on the
`runtime.engine.Engine` this object holds (``engine``); its training-loop methods and
attributes are exposed here unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dcparallel.adapters.base import LossFn, ModelAdapter
from dcparallel.adapters.find import find_adapter
from dcparallel.cost.auto_shard import auto_shard_size, explain_shard_size
from dcparallel.cost.base import unsharded_grad_bytes
from dcparallel.cost.grad_hold import hold_unsharded_grads
from dcparallel.cost.profiled import ProfiledCost
from dcparallel.cost.schema import Profile
from dcparallel.data.batch import Batch
from dcparallel.data.loader import DataCentricLoader
from dcparallel.data.rollouts import rollout_sizes
from dcparallel.data.sizes import check_step_budget, read_sizes
from dcparallel.plan.policies import user_policy
from dcparallel.profile.cpu_calibration import analytic_cost
from dcparallel.profile.of_engine import profile_engine
from dcparallel.profile.profiler import ProfilerConfig
from dcparallel.runtime import comm
from dcparallel.runtime.auto_launch import agreed_auto_shard_size, priced_cluster, set_up_launch
from dcparallel.runtime.autocast import under_autocast, with_autocast
from dcparallel.runtime.buffers import check_buffers_agree
from dcparallel.runtime.engine import Engine, MicroBatchContext
from dcparallel.runtime.forward_pass import ForwardFn, ForwardPass
from dcparallel.runtime.launch import cluster_from_env, default_device, device_memory
from dcparallel.runtime.param_groups import GroupedZeroAdamW, as_groups
from dcparallel.runtime.rollout_step import RolloutPlanner, RolloutStep
from dcparallel.runtime.sharded_optim import ShardedAdamW
from dcparallel.runtime.zero import ZeroAdamW

log = logging.getLogger(__name__)


def _local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size()))


def _of_engine(name: str, doc: str) -> property:
    """A read-only attribute of the held `Engine`."""
    return property(lambda self: getattr(self.engine, name), doc=doc)


class DataCentricParallel:
    """A `runtime.engine.Engine` (``engine``) plus `prepare`: profile (cached) -> plan -> load.

    ``model``: a reference model, a transformers causal LM, a diffusers Wan / ChronoEdit /
    LTX-Video / Flux / HunyuanVideo / CogVideoX / Mochi transformer, or
    any module following `dcparallel.adapters.protocol_adapter`'s protocol (``layers``,
    ``num_heads``, ...) — or pass ``adapter``; built under `dcparallel.empty_init` (on the
    meta device) with shard_size > 1, it gets its weights from `load_weights`. ``policy``: `dcp`, `bucket`
    or `packed` (`dcparallel.plan.policies.POLICIES`); ``research=True`` also takes a research
    policy's name (`RESEARCH`: the ablations and reproductions, for experiments and tests).
    ``loss_fn(model, batch, ctx)``: one micro-batch's work (forward + `ctx` loss helper);
    the default is the adapter's (next-token loss for LMs, flow matching for video);
    the profiler measures exactly this function.
    ``shard_size``: parameters and gradients sharded (FSDP2) inside aligned blocks of this
    many ranks (`runtime.sharded`; 1 = replicated, in the flat buffers); every SP group the
    plans use (and the profiler measures) is then made of whole blocks. ``"auto"``: the
    smallest shard size with which the model states fit ``memory_bytes`` (decided here, the
    same on every rank, logged), checked in `prepare` against the smallest sample too.
    ``memory_bytes``: usable memory per rank for model states and activations (default: 90%
    of the GPU; on CPU the machine's memory / local ranks). ``protocol``: further arguments
    of the model protocol (``kind``, ``sample_fn``, ``blocks_per_layer``, ``context_tokens``
    for diffusers models, ...). ``ring``: SP groups past the head count too, Ulysses x ring
    attention (`runtime.ring`; profiled at `Topology.profiled_splits`, `cost.profiled`).
    ``autocast``: the dtype (torch.bfloat16 / float16) the loop runs each forward in under
    `torch.autocast` (the HF Trainer's ``bf16=True``): the profiler measures under it too, and
    its 16-bit copies of the fp32 weights count as model states (`runtime.autocast`).
    Everything is validated before the model is touched.
    Started by torchrun with no process group set up, it sets one up and moves a CPU model to
    this rank's device (`runtime.auto_launch`); one set up before (`dcparallel.init_distributed`)
    is used as it is."""

    def __init__(
        self,
        model: nn.Module,
        *,
        layers: Sequence[nn.Module] | None = None,
        policy: str = "dcp",
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        adapter: ModelAdapter | None = None,
        loss_fn: LossFn | None = None,
        memory_bytes: int | None = None,
        gpus_per_node: int | None = None,
        seed: int = 0,
        kernel: Any = None,
        groups: Any = None,
        shard_size: int | str = 1,
        ring: bool = False,
        research: bool = False,
        autocast: torch.dtype | None = None,
        **protocol: Any,
    ):
        user_policy(policy, "DataCentricParallel", research=research)
        if not isinstance(ring, bool):
            raise ValueError(f"ring={ring!r}: give True (SP groups past the head count, Ulysses x ring) or False")
        if memory_bytes is not None and memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be a positive number of bytes per rank; got {memory_bytes!r}")
        if shard_size != "auto" and (isinstance(shard_size, bool) or not isinstance(shard_size, int)):
            raise ValueError(
                f"shard_size={shard_size!r}: give an int (1, 2, 4, ... dividing a node, or a multiple of "
                f"a node) or 'auto'"
            )
        adapter = adapter or find_adapter(
            model, layers=layers, num_heads=num_heads, num_kv_heads=num_kv_heads, **protocol
        )
        #: the dtype of the training loop's `torch.autocast` around each forward (None: none)
        self.autocast = autocast
        adapter = with_autocast(adapter, model, autocast)  # its 16-bit weight copies are model states
        set_up_launch(model)  # under torchrun: the process group and this rank's device, unless set up already
        device = next(model.parameters()).device
        if device.type == "meta":  # built under `empty_init`: its shards get storage on this launch's device
            device = default_device()
        world = comm.world_size()
        self.memory_bytes = int(memory_bytes or device_memory(device, min(_local_world(), world)))
        g = gpus_per_node or min(_local_world(), world)
        # world, GPUs per node, memory and link speeds of this launch (runtime/launch.py), and ring
        # before the shard size: its SP groups past the head count allow sizes the heads do not divide
        cluster = cluster_from_env(memory_bytes=self.memory_bytes, gpus_per_node=g, device=device)
        cluster = dataclasses.replace(cluster, ring=ring)
        #: shard_size="auto" was asked for: `prepare` checks the choice against the samples too
        self.shard_auto = shard_size == "auto"
        if self.shard_auto:
            shard_size = agreed_auto_shard_size(adapter.spec, cluster)
        self.cluster_spec = dataclasses.replace(cluster, shard_size=shard_size)
        self.engine = Engine(model, adapter=adapter, cluster=self.cluster_spec, seed=seed, kernel=kernel, groups=groups)
        #: the budget was measured here, not given: `prepare` agrees on the smallest over ranks
        self.memory_measured = memory_bytes is None
        if self.memory_measured:  # the process groups' communicators hold device memory too
            self._set_memory(self.memory_bytes - int(getattr(self.engine.groups, "communicator_bytes", 0)))
        self.policy, self.research, self.spec = policy, research, adapter.spec
        self.loss_fn: LossFn | None = loss_fn or adapter.loss_fn
        self.profile = None
        self.cost = None
        self.loader: DataCentricLoader | None = None
        self.rollouts: RolloutPlanner | None = None

    def _set_memory(self, memory_bytes: int) -> None:
        if memory_bytes <= 0:
            raise ValueError(
                f"the process groups' communicators take all of the device memory budget (left: "
                f"{memory_bytes} bytes); pass memory_bytes, or use fewer SP sizes (a larger shard_size)"
            )
        self.memory_bytes = int(memory_bytes)
        self.cluster_spec = dataclasses.replace(self.cluster_spec, memory_bytes=self.memory_bytes)

    def _agree_inputs(self, sizes: Sequence[Any], plan_kw: dict[str, Any]) -> None:
        """Every rank plans on its own, so every input of the plans must be the same on every
        rank: checked once on the control group (a ValueError names what differs). A budget
        measured from the device is first agreed as the smallest over ranks."""
        group = comm.control_group()
        if self.memory_measured:
            least = min(comm.all_gather_object(self.memory_bytes, group))
            if least != self.memory_bytes:
                log.info(
                    "rank %d: memory budget %s -> %s, the smallest of any rank",
                    comm.world_rank(),
                    self.memory_bytes,
                    least,
                )
                self._set_memory(least)
        c = self.cluster_spec
        comm.check_agree(
            {
                "memory budget (memory_bytes)": (
                    c.memory_bytes,
                    "pass the same memory_bytes on every rank, or none (then the smallest device's is used)",
                ),
                "cluster spec": (
                    dataclasses.replace(c, memory_bytes=1),
                    "launch every rank with the same world size, "
                    "GPUs per node (LOCAL_WORLD_SIZE) and link speeds ($DCPARALLEL_LINKS)",
                ),
                "policy and step budget": (
                    (self.policy, self.seed, sorted(plan_kw.items())),
                    "pass the same policy, seed and step budget on every rank",
                ),
                "sample sizes": (comm.digest(tuple(sizes)), "read the same dataset and lengths on every rank"),
                **(
                    {
                        "trainable parameters": (
                            self._weights_fingerprint(),
                            "build the same weights on every rank: seed "
                            "random initialization (e.g. torch.manual_seed before peft.get_peft_model)"
                            " or load the same checkpoint",
                        )
                    }
                    if self.shard_size == 1
                    else {}
                ),
            },
            "prepare",
            group,
        )
        check_buffers_agree(self.model, "prepare", group)  # replicated: one checkpointed copy resumes every rank

    def _weights_fingerprint(self) -> tuple[float, float]:
        """The sum and norm (fp64, on the device, no copy) of the replicated trainable parameters:
        replicas that start apart (adapters initialized from each rank's own generator) would
        each train other weights, so `prepare` refuses them."""
        flat = self.engine.flat_param.detach()
        return float(flat.sum(dtype=torch.float64)), float(torch.linalg.vector_norm(flat, dtype=torch.float64))

    def _agree_cost(self) -> None:
        """The cost model's content (a profile's every entry, not its fingerprint: a node-local
        cached profile may differ) is the same on every rank, else a ValueError."""
        content = self.profile.to_json() if self.profile is not None else (self.spec, self.cost.cluster)
        comm.check_agree(
            {
                "cost model": (
                    content,
                    "delete the cached profile files on every node and profile "
                    "again (or share one profile_path between nodes)",
                )
            },
            "prepare",
            comm.control_group(),
        )

    # ------------------------------------------------------------------ the engine's, unchanged

    model = _of_engine("model", "the wrapped model")
    adapter = _of_engine("adapter", "how the model is driven (`dcparallel.adapters.ModelAdapter`)")
    layers = _of_engine("layers", "the model's repeated blocks")
    num_heads = _of_engine("num_heads", "attention heads of the model")
    num_kv_heads = _of_engine("num_kv_heads", "key / value heads of the model")
    params = _of_engine("params", "the trainable parameters, views of ``flat_param``")
    seed = _of_engine("seed", "the seed of per-sample randomness and of the loader's shuffle")
    epoch = _of_engine("epoch", "the epoch of per-sample randomness (`set_epoch`)")
    groups = _of_engine("groups", "every process group (`runtime.groups.ProcessGroups`)")
    rank = _of_engine("rank", "this rank in the world")
    world_size = _of_engine("world_size", "ranks in the world")
    grad_sync = _of_engine("grad_sync", "the flat buffers and the step's gradient sync (`runtime.grad_sync`)")
    flat_param = _of_engine("flat_param", "the flat parameter buffer")
    flat_grad = _of_engine("flat_grad", "the flat fp32 gradient buffer (+ loss and target count)")
    numel = _of_engine("numel", "trainable parameter elements")
    shard_numel = _of_engine("shard_numel", "flat parameter elements per rank's ZeRO-1 shard")
    last_loss = _of_engine("last_loss", "the last step's mean loss")
    last_count = _of_engine("last_count", "the last step's global target count")
    shard_size = _of_engine("shard_size", "ranks per parameter-shard block (1: parameters replicated)")

    def micro_batch(
        self, batch: Batch, last: bool | None = None
    ) -> contextlib.AbstractContextManager[MicroBatchContext]:
        """`Engine.micro_batch`: runs one micro-batch on this rank (a context manager)."""
        return self.engine.micro_batch(batch, last)

    def load_weights(self, folder: str | Path) -> None:
        """`Engine.load_weights`: the weights of a ``save_pretrained`` folder (safetensors),
        each rank reading only its shards. A model built under `dcparallel.empty_init` (on the
        meta device, shard_size > 1) gets its weights this way, before `prepare`."""
        self.engine.load_weights(folder)

    def sync_gradients(self, normalizer: float | None = None) -> float:
        """`Engine.sync_gradients`: the step's one gradient sync; the step's mean loss.
        ``normalizer``: divide by this constant instead of the step's target count."""
        return self.engine.sync_gradients(normalizer)

    def zero_grad(self) -> None:
        """`Engine.zero_grad`: starts a new step's accumulation."""
        self.engine.zero_grad()

    def optimizer(
        self,
        params_or_groups: Iterable[Any] | None = None,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> ZeroAdamW | ShardedAdamW:
        """AdamW with ZeRO-1 sharded fp32 state, a `torch.optim.Optimizer` (schedulers drive
        it). The defaults are torch.optim.AdamW's (lr 1e-3, betas (0.9, 0.999), eps 1e-8,
        weight_decay 1e-2). ``params_or_groups``: None (every trainable parameter, one group;
        weight decay on matrices only, not on biases and norms: `Engine.optimizer`), or as for
        torch's AdamW, parameters or groups (dicts with ``params`` and any of ``lr``,
        ``betas``, ``eps``, ``weight_decay``): torch's rule then, every tensor of a group
        decayed by its group's weight_decay, a parameter in no group not updated
        (`runtime.param_groups`). Groups need shard_size 1."""
        if params_or_groups is None:
            return self.engine.optimizer(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        groups = as_groups(params_or_groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        if self.shard_size > 1:
            raise ValueError(
                f"dc.optimizer() with parameter groups needs shard_size 1 (this model's is "
                f"{self.shard_size}); give no groups (one group, weight decay on matrices)"
            )
        self.engine.optimizer_made = True
        return GroupedZeroAdamW(self.engine.grad_sync, groups)

    def full_gradients(self) -> dict[str, Any]:
        """`Engine.full_gradients`: the step's whole gradient of every trainable parameter by
        name, fp32 copies (collective with shard_size > 1 or with the ZeRO-1 optimizer on several
        ranks: every rank calls it, after `sync_gradients`)."""
        return self.engine.full_gradients()

    def gradients(self) -> dict[str, Any]:
        """`Engine.gradients`: the step's fp32 gradients by name, views of the synced buffer (no
        copy; shard size 1, and one rank once the engine's optimizer exists: on several its sync
        sums only each rank's shard). A bf16 parameter's ``p.grad`` is None with the engine's optimizer."""
        return self.engine.gradients()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """`Engine.clip_grad_norm_`: scales the synced gradients to a global norm <= ``max_norm``
        (torch's rule, over shards and replicas); the pre-clip norm. Between `sync_gradients`
        and ``opt.step()``."""
        return self.engine.clip_grad_norm_(max_norm, norm_type)

    def recompute_modes(self) -> list[str]:
        """`Engine.recompute_modes`: the recompute mode of every block right now."""
        return self.engine.recompute_modes()

    def set_epoch(self, epoch: int) -> None:
        """The epoch for per-sample randomness and, once `prepare` made it, the loader's
        shuffle: one call at the top of each epoch."""
        self.engine.set_epoch(epoch)
        if self.loader is not None:
            self.loader.set_epoch(epoch)

    def _choose_grad_hold(self, sizes: Sequence[Any]) -> None:
        """Shard blocks: FSDP keeps the gradients whole until a block's last micro-batch of the
        step when they fit with the epoch's samples (`cost.grad_hold`); the planner then counts
        them in the states every micro-batch finds."""
        hold, why = hold_unsharded_grads(self.cost, self.spec, self.cost.cluster, sizes)
        if hold:
            self.cost.add_state_bytes(unsharded_grad_bytes(self.spec))
        self.engine.grad_sync.set_accumulate_unsharded(hold)
        log.info("gradient accumulation %s: %s", "whole" if hold else "sharded", why)

    def _check_auto_shard_size(self, sizes: Sequence[Any]) -> None:
        """``shard_size="auto"`` chose from the model states alone; with the samples known, the
        smallest must fit alone (and the largest some layout) at that shard size, else the
        shard size that fits is named (`cost.auto_shard.auto_shard_size`)."""
        c = self.cluster_spec
        priced = priced_cluster(c, memory_bytes=min(comm.all_gather_object(c.memory_bytes)))
        try:
            need = auto_shard_size(self.spec, priced, list(sizes))
        except ValueError as e:
            raise ValueError(
                f"shard_size='auto' chose {self.shard_size} from the model states, but with these samples: {e}"
            ) from None
        if need > self.shard_size:
            _, why = explain_shard_size(self.spec, priced, list(sizes))
            raise ValueError(
                f"shard_size='auto' chose {self.shard_size} from the model states when the model was "
                f"wrapped, but with these samples {why.removeprefix(f'shard_size auto -> {need}: ')}: "
                f"pass shard_size={need}"
            )

    def prepare(
        self,
        dataset: Any,
        *,
        lengths: Any,
        tokens_per_step: int | None = None,
        samples_per_step: int | None = None,
        cost: str = "profiled",
        profile_path: str | Path = "dcparallel_profile.json",
        profiler_config: ProfilerConfig | Mapping[str, Any] | None = None,
        loss_fn: LossFn | None = None,
        **loader_kw: Any,
    ) -> DataCentricLoader:
        """Prices the model's layouts and returns the loader that plans every step with them.
        ``cost``: "profiled" measures the model here (or reuses the cached profile at
        ``profile_path``); "analytic" prices from the analytic model fitted to measured H200
        numbers (`cost.analytic`), without profiling: plans for a GPU cluster; on a CPU its
        time constants are timed here first, seconds, cached beside ``profile_path``
        (`profile.cpu_calibration`). ``loss_fn`` (default: the one given at
        construction, else the adapter's) is what the profiler runs on synthetic
        micro-batches; run the same one in the training loop. ``profiler_config``: a
        `ProfilerConfig`, or a mapping of its fields that override the default
        (`ProfilerConfig.quick`: a 300 s wall-time budget, enforced; capped at the
        dataset's longest sample and the memory budget; saved as it goes, so a killed profile
        resumes), e.g. ``{"repeats": 1, "max_repeats": 2, "modes": ("none", "full")}`` for a short profile.
        ``loader_kw``: further arguments of `DataCentricLoader`. Call on every rank together
        (profiling is collective)."""
        if cost not in ("profiled", "analytic"):
            raise ValueError(
                f"cost={cost!r}: give 'profiled' (measure the model) or 'analytic' (the analytic "
                f"cost model, no profiling)"
            )
        if cost == "analytic" and profiler_config is not None:
            raise ValueError("profiler_config is for cost='profiled'; cost='analytic' profiles nothing: drop it")
        check_step_budget(tokens_per_step, samples_per_step)  # before minutes of profiling
        self.loss_fn = loss_fn or self.loss_fn
        if self.loss_fn is None:
            raise ValueError(
                f"{self.adapter.name} has no default loss: pass loss_fn(model, batch, ctx) returning "
                f"the micro-batch's summed loss (e.g. ctx.token_loss(...)); it is profiled and trained"
            )
        sizes = read_sizes(lengths, len(dataset))
        plan_kw = {
            "tokens_per_step": tokens_per_step,
            "samples_per_step": samples_per_step,
            **{k: loader_kw[k] for k in ("skip_oversize", "epoch") if k in loader_kw},
        }
        self._agree_inputs(sizes, plan_kw)  # before minutes of profiling
        if self.shard_auto:
            self._check_auto_shard_size(sizes)
        self._price(cost, sizes, profile_path, profiler_config)
        if self.shard_size > 1:
            self._choose_grad_hold(sizes)
        loader_kw.setdefault("collate", self.adapter.collate)
        loader_kw.setdefault("device", self.params[0].device)  # batches go where the model is
        loader_kw.setdefault("epoch", self.epoch)
        self.loader = DataCentricLoader(
            dataset,
            sizes,
            cost=self.cost,
            cluster=self.cluster_spec,
            policy=self.policy,
            research=self.research,
            tokens_per_step=tokens_per_step,
            samples_per_step=samples_per_step,
            seed=self.seed,
            **loader_kw,
        )
        return self.loader

    def prepare_rollouts(
        self,
        *,
        max_tokens: int,
        cost: str = "profiled",
        profile_path: str | Path = "dcparallel_profile.json",
        profiler_config: ProfilerConfig | Mapping[str, Any] | None = None,
        loss_fn: LossFn | None = None,
        check_plans: int = 50,
    ) -> RolloutPlanner:
        """`prepare` for steps made at run time (RL rollouts): prices the model's layouts for
        samples of up to ``max_tokens`` tokens (``cost``, ``profile_path``, ``profiler_config``,
        ``loss_fn`` as in `prepare`), after which `plan_batch` plans each step. Collective."""
        if cost not in ("profiled", "analytic") or (cost == "analytic" and profiler_config is not None):
            raise ValueError(f"cost={cost!r}: give 'profiled' or 'analytic' (with no profiler_config)")
        self.loss_fn = loss_fn or self.loss_fn
        sizes = rollout_sizes(max_tokens)
        self._agree_inputs(sizes, {"max_tokens": max_tokens})
        self._price(cost, sizes, profile_path, profiler_config)
        self.rollouts = RolloutPlanner(
            self.cost,
            self.cluster_spec,
            self.policy,
            device=self.params[0].device,
            check_plans=check_plans,
            max_tokens=max_tokens,
        )
        self.forward_pass = ForwardPass(
            self.engine,
            self.cost,
            self.cluster_spec,
            self.policy,
            device=self.params[0].device,
            check_plans=check_plans,
        )
        return self.rollouts

    def plan_batch(self, samples: Sequence[Mapping[str, Any]]) -> RolloutStep:
        """Plans one step from the rollouts every rank holds (`runtime.rollout_step`): lengths
        exchanged, the policy's plan, each rollout moved to the ranks that run it. ``samples``:
        this rank's rollouts, mappings of ``input_ids`` and per-token tensors (`data.rollouts`).
        Collective: every rank calls it, with its own rollouts (maybe none)."""
        if self.rollouts is None:
            raise ValueError("plan_batch needs a cost model: call dc.prepare_rollouts(max_tokens=...) first")
        return self.rollouts.plan(samples)

    def forward_batch(self, samples: Sequence[Mapping[str, Any]], fn: ForwardFn) -> list[Any]:
        """A forward-only pass over the ranks' rollouts, planned with forward-only costs
        (`runtime.forward_pass`): ``fn(model, batch)`` gives (B, Ls) outputs aligned with
        ``batch.labels`` (e.g. the labels' log-probs); returns one float32 tensor per rollout
        of this rank, in its order, entry t for token t. Collective, like `plan_batch`."""
        if self.rollouts is None:
            raise ValueError("forward_batch needs a cost model: call dc.prepare_rollouts(max_tokens=...) first")
        return self.forward_pass.run(samples, fn)

    def _price(
        self,
        cost: str,
        sizes: Sequence[Any],
        profile_path: str | Path,
        profiler_config: ProfilerConfig | Mapping[str, Any] | None,
    ) -> None:
        """The cost model of ``cost``: the analytic one, or a profile of this model (measured
        now, collective, or cached) — the same on every rank (checked)."""
        if cost == "analytic":  # on a CPU, its time constants timed here (`profile.cpu_calibration`)
            longest = max((self.spec.tokens(s) for s in sizes), default=1)  # attention timed up to it
            cluster = priced_cluster(self.cluster_spec)
            self.cost = analytic_cost(self.spec, cluster, self.params[0].device, profile_path, longest)
        else:
            self.profile = self._profile(sizes, Path(profile_path), profiler_config)
            self.cost = ProfiledCost(self.profile, self.cluster_spec)
        self._agree_cost()

    def _profile(
        self, sizes: Sequence[Any], path: Path, profiler_config: ProfilerConfig | Mapping[str, Any] | None
    ) -> Profile:
        loss_fn = under_autocast(self.loss_fn, self.params[0].device, self.autocast)  # measured as trained
        return profile_engine(self.engine, self.spec, loss_fn, sizes, path, profiler_config, self.memory_bytes)
