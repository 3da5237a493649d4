"""The parts of the device check (benchmarks/tools/device_check.py), one per process:

    python benchmarks/tools/device_check_parts.py PART[,PART...] --out-dir DIR [--dry-run]

writes DIR/part_PART.json (several parts: one after the other in this process, as the dry run
runs them). ``c-rank`` is the torchrun worker of part (c) and ``b-train`` the
one-model training process of part (b); device_check.py runs the others, each with its own
time limit. ``--dry-run``: CPU, gloo and tiny sizes (checks the code, not the numbers).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "benchmarks" / "tools"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn, dev: torch.device, repeats: int) -> float:
    fn()
    _sync(dev)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _memory(dev: torch.device) -> dict:
    """Peak allocated and reserved bytes since the last reset, and the device's free / total."""
    if dev.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(dev)
    return {
        "max_allocated": torch.cuda.max_memory_allocated(dev),
        "max_reserved": torch.cuda.max_memory_reserved(dev),
        "mem_get_info_free": free,
        "mem_get_info_total": total,
    }


def save(out_dir: Path, key: str, result: dict) -> None:
    """The part's result so far: device_check.py reports it if the part runs out of time."""
    (out_dir / f"part_{key}.json").write_text(json.dumps(result, indent=1, default=str))


# In the dry run a part's one-process workers (part (a)'s profiler run, (b)'s training of each
# model, (c)'s world-1 reference) run in the part's own process: on the GPU each gets a process
# for its memory peak and its time limit, which the dry run's tiny sizes do not need, while a
# process costs more than their work (torch's imports). torchrun's ranks are processes in both.


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env or ENV)


# ---------------------------------------------------------------- (a) profile validation


def part_a(out_dir: Path, dry: bool) -> dict:
    """`profile --validate` of two stacks (benchmarks/tools/profile_device_check.py): extrapolated
    time and memory against the full-depth run."""
    budget = 40.0 if dry else 90.0  # no model starts past it; the part's limit is 155 s
    cmd = [
        sys.executable,
        str(TOOLS / "profile_device_check.py"),
        "--out-dir",
        str(out_dir),
        "--budget-s",
        str(budget),
    ] + (["--dry-run"] if dry else [])
    try:
        if dry:  # in this process (see above `_run`)
            code, tail = _in_process_profile(cmd[2:]), ""
        else:
            r = _run(cmd, timeout=budget + 50)
            code, tail = r.returncode, (r.stdout + r.stderr)[-1500:]
    except subprocess.TimeoutExpired as exc:  # the report holds the models it finished
        code, tail = "timed out", str(exc.stderr or "")[-1500:]
    reports = sorted(out_dir.glob("profile-device_*.md"))
    return {
        "returncode": code,
        "report": reports[-1].name if reports else None,
        "tail": tail,
        "table": reports[-1].read_text() if reports else "",
    }


def _in_process_profile(argv: list[str]) -> int:
    """benchmarks/tools/profile_device_check.py's ``main(argv)`` in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_device_check", TOOLS / "profile_device_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


# ---------------------------------------------------------------- (b) bf16 training at world 1

#: the [model] TOML of (b)'s two models: (dry run, GPU)
MODELS_B = {
    "reference": (
        "hidden = 64\nnum_layers = 2\nnum_heads = 4\nffn_hidden = 176\nvocab_size = 256\n",
        "hidden = 2048\nnum_layers = 8\nnum_heads = 16\nffn_hidden = 5632\nvocab_size = 32000\n",
    ),
    "transformers": (
        'family = "transformers"\narchitecture = "LlamaForCausalLM"\n[model.config]\nvocab_size = 256\n'
        "hidden_size = 64\nintermediate_size = 128\nnum_hidden_layers = 2\nnum_attention_heads = 8\n"
        "num_key_value_heads = 2\n",
        'family = "transformers"\narchitecture = "LlamaForCausalLM"\n[model.config]\nvocab_size = 32000\n'
        "hidden_size = 2048\nintermediate_size = 8192\nnum_hidden_layers = 8\nnum_attention_heads = 32\n"
        "num_key_value_heads = 8\nmax_position_embeddings = 32768\n",
    ),
}


def part_b(out_dir: Path, dry: bool) -> dict:
    """A few `dcparallel train` steps at world 1 in bf16 of the reference LM and a transformers
    Llama (GQA 32/8), each in a process of its own: planned vs measured step time and peak."""
    out = {}
    for name in MODELS_B:
        try:
            if dry:  # in this process (see above `_run`)
                out[name] = train_one(out_dir, dry, name)
                save(out_dir, "b", out)
                continue
            r = _run(
                [sys.executable, __file__, "b-train", "--model", name, "--out-dir", str(out_dir)]
                + (["--dry-run"] if dry else []),
                timeout=200 if dry else 52,
            )
            if r.returncode:
                raise RuntimeError(f"exit {r.returncode}: {r.stderr[-1500:]}")
            out[name] = json.loads((out_dir / f"train_{name}.json").read_text())
        except Exception as exc:  # noqa: BLE001 - one model's failure is reported, the other still runs
            out[name] = {"error": f"{_err(exc)}\n{str(exc)[-1500:]}"}
        save(out_dir, "b", out)
    return out


def train_one(out_dir: Path, dry: bool, name: str) -> dict:
    from dcparallel.apps.cli import main as cli

    lengths = out_dir / "lengths_b.txt"
    lengths.write_text(
        "\n".join(
            str(n)
            for n in ([24, 40, 64, 100, 180, 30] * 4 if dry else [512, 2048, 8192, 1024, 300, 4096, 700, 16384] * 4)
        )
        + "\n"
    )
    tokens, steps, cap = (700, 3, 512) if dry else (32768, 5, 16384)
    cost = "analytic" if dry else "profiled"  # the dry run's profiling is part (a)'s
    run_dir = out_dir / f"train_{name}"
    config = out_dir / f"train_{name}.toml"
    config.write_text(
        f'[data]\nlengths = "{lengths}"\n[train]\npolicy = "dcp"\ntokens_per_step = {tokens}\n'
        f'max_steps = {steps}\nout_dir = "{run_dir}"\ndtype = "{"float32" if dry else "bfloat16"}"\n'
        f"[profile]\nrepeats = 1\nmax_repeats = {1 if dry else 4}\nmin_time_s = {0.0 if dry else 0.05}\n"
        f'max_mbs = 2\nmax_tokens = {cap}\ncost = "{cost}"\n'
        f"[model]\n{MODELS_B[name][0 if dry else 1]}"
    )
    dev = torch.device("cuda", 0) if torch.cuda.is_available() and not dry else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    if cli(["train", "--config", str(config)]):
        raise RuntimeError(f"dcparallel train {name} failed")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = (
        "global_step",
        "step_s",
        "planned_compute_s",
        "planned_peak_memory_bytes",
        "measured_peak_memory_bytes",
        "loss",
    )
    return {"steps": [{k: x.get(k) for k in keys} for x in rows], "process_memory": _memory(dev)}


# ---------------------------------------------------------------- (c) several ranks on one GPU


def part_c(out_dir: Path, dry: bool) -> dict:
    """World 1 (the reference), then torchrun worlds 2 and 4 sharing cuda:0 over gloo
    (DCPARALLEL_BACKEND=gloo, DCPARALLEL_SHARE_DEVICE=1), with the ZeRO-1 optimizer, so the
    sync reduces each bucket into its shard's owner: loss, gradients (gathered from the
    shards) and the clipping norm (on the shards) against world 1, host syncs, the overlap of
    the gradient sync; world 2 ends in an out-of-memory error on rank 1 that must stop both
    ranks."""
    env = {**ENV, "DCPARALLEL_BACKEND": "gloo", "DCPARALLEL_SHARE_DEVICE": "1", "OMP_NUM_THREADS": "1"}
    flag = ["--dry-run"] if dry else []
    out: dict = {}
    if dry:  # in this process (see above `_run`)
        rank_c(out_dir, dry, oom=False)
    else:
        r = _run([sys.executable, __file__, "c-rank", "--out-dir", str(out_dir)], 25, env)
        if r.returncode:
            raise RuntimeError(f"world 1 reference failed ({r.returncode}): {r.stderr[-1500:]}")
    out["world1"] = json.loads((out_dir / "c_world1.json").read_text())
    for world in (2,) if dry else (2, 4):
        t = time.perf_counter()
        cmd = (
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={world}",
                __file__,
                "c-rank",
                "--out-dir",
                str(out_dir),
            ]
            + flag
            + (["--oom"] if world == 2 else [])
        )
        try:
            r = _run(cmd, 200 if dry else 35, env)
        except subprocess.TimeoutExpired as exc:
            out[f"world{world}"] = {"error": f"timed out (a hang?): {str(exc.stderr or '')[-1500:]}"}
            continue
        res = out_dir / f"c_world{world}.json"
        got = (
            json.loads(res.read_text())
            if res.exists()
            else {"error": f"no result ({r.returncode}): {r.stderr[-1500:]}"}
        )
        if world == 2:
            got["oom"] = {
                "returncode": r.returncode,
                "seconds": time.perf_counter() - t,
                "rank1_message": "rank 1: out of memory in step" in r.stderr,
                "rank0_went_on": "rank 0 finished after the OOM" in r.stderr,
                "stopped_every_rank": r.returncode != 0 and "rank 0 finished after the OOM" not in r.stderr,
            }
        out[f"world{world}"] = got
        save(out_dir, "c", out)
    return out


def _c_plan(world: int) -> list[tuple[tuple[int, ...], tuple[int, ...], bool, int]]:
    """(ranks, documents, recompute, ring degree) of each micro-batch: SP 4 (Ulysses 2 x ring 2
    and Ulysses 4) and 2 (world 4) or 2 (ring 2) and 1 (world 2) in one step; world 1 runs
    every document on rank 0."""
    if world == 4:
        every = (0, 1, 2, 3)
        return [(every, (3,), False, 2), ((0, 1), (1, 2), True, 1), ((2, 3), (4, 5), False, 1), (every, (0,), False, 1)]
    if world == 2:
        return [((0, 1), (3, 1), False, 2), ((0,), (0, 2), True, 1), ((1,), (4, 5), False, 1)]
    return [((0,), (3,), False, 1), ((0,), (1, 2), True, 1), ((0,), (0, 4, 5), False, 1)]


def _c_step(engine, model, docs: dict, rank: int, world: int, *, overlap: bool = True) -> float:
    _c_micro_batches(engine, model, docs, rank, world, overlap)
    return engine.sync_gradients()


def _c_micro_batches(engine, model, docs: dict, rank: int, world: int, overlap: bool = True) -> None:
    """This rank's micro-batches of `_c_plan`; the last one's backward launches the gradient
    sync when ``overlap``."""
    from dcparallel.data.collate import text_batch
    from dcparallel.loss import per_token_loss
    from dcparallel.plan.types import MicroBatch
    from dcparallel.spec import Layout, Recompute

    mine = [m for m in _c_plan(world) if rank in m[0]]
    for j, (ranks, ids, rc, ring) in enumerate(mine):
        layout = Layout(len(ranks), len(ids), Recompute.full(len(engine.layers)) if rc else Recompute.none(), ring)
        batch = text_batch(MicroBatch(ids, layout), ranks, rank, docs).to(engine.params[0].device)
        with engine.micro_batch(batch, last=overlap and j == len(mine) - 1) as ctx:
            ptl, _ = per_token_loss(model(batch.inputs, batch.positions), batch.labels)
            ctx.backward(ctx.token_loss(ptl, batch.loss_mask))


def _c_model(dry: bool, dev: torch.device):
    from dcparallel.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = (
        LlamaConfig(vocab_size=256, hidden=64, num_layers=2, num_heads=8, ffn_hidden=176)
        if dry
        else LlamaConfig(vocab_size=32000, hidden=1024, num_layers=4, num_heads=16, ffn_hidden=2816)
    )
    return Llama(cfg).to(dev, torch.float32 if dry else torch.bfloat16)


def _count_syncs(fn) -> dict:
    """Runs ``fn`` under torch.cuda.set_sync_debug_mode("warn"): the host syncs it makes, by
    the source line that made them."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in seen if "synchroniz" in str(w.message)]
    where: dict[str, int] = {}
    for w in syncs:
        key = f"{Path(w.filename).name}:{w.lineno}"
        where[key] = where.get(key, 0) + 1
    return {"host_syncs": len(syncs), "by_line": where}


def rank_c(out_dir: Path, dry: bool, oom: bool) -> None:
    from dcparallel.runtime import comm
    from dcparallel.runtime.engine import Engine
    from dcparallel.runtime.groups import ProcessGroups
    from dcparallel.runtime.launch import end_distributed, init_distributed

    launch = init_distributed("cpu" if dry else None)
    rank, world, dev = launch.rank, launch.world_size, launch.device
    g = torch.Generator().manual_seed(1)
    lengths = [37, 120, 64, 9, 200, 50] if dry else [700, 2048, 1300, 77, 4000, 900]
    docs = {i: torch.randint(0, 256, (n,), generator=g) for i, n in enumerate(lengths)}
    model = _c_model(dry, dev)
    groups = ProcessGroups(model.cfg.num_heads, ring=True)  # ring splits of the SP groups (`_c_plan`)
    engine = Engine(model, layers=model.layers, num_heads=model.cfg.num_heads, groups=groups)
    engine.optimizer(lr=1e-4)  # ZeRO-1: with several ranks each bucket is reduced into its shard's owner
    gs = engine.grad_sync
    into_rank0 = sum(hi - lo for (lo, hi), o in zip(gs.buckets, gs.bucket_owners, strict=True) if o in (None, 0))
    out: dict = {
        "world": world,
        "backend": launch.backend,
        "device": str(dev),
        "sync": {
            "sharded": gs.sharded,
            "buckets": gs.num_buckets,
            "all_reduced": sum(o is None for o in gs.bucket_owners),
            "bytes_summed_into_rank0": 4 * into_rank0,
            "buffer_bytes": 4 * gs.flat_grad.numel(),
        },
    }
    out["loss"] = _c_step(engine, model, docs, rank, world)
    out["sync"]["overlapped_buckets"] = gs.last_overlapped
    grads = {k: v.float().cpu() for k, v in engine.full_gradients().items()}  # gathered from the shards
    norm = engine.clip_grad_norm_(1e30)  # on the shards: one scalar all-reduce
    if world == 1:
        torch.save({"loss": out["loss"], "grads": grads, "norm": norm}, out_dir / "c_ref.pt")
    else:
        ref = torch.load(out_dir / "c_ref.pt")
        errs = {k: _rel(grads[k], v) for k, v in ref["grads"].items()}
        out |= {
            "loss_world1": ref["loss"],
            "loss_rel_err": abs(out["loss"] - ref["loss"]) / abs(ref["loss"]),
            "max_rel_grad_err": max(errs.values()),
            "worst_tensor": max(errs, key=errs.get),
            "tensors": len(errs),
            "within_1e-2": max(errs.values()) <= 1e-2,
            "grad_norm_rel_err": abs(norm - ref["norm"]) / ref["norm"],
        }
    if dev.type == "cuda":  # this rank's micro-batches (two or three) under the sync debugger
        out["syncs"] = _count_syncs(lambda e=engine, m=model: _c_micro_batches(e, m, docs, rank, world))
        engine.sync_gradients()  # returns the loss as a float: one sync a step, by design
    times = {}
    for overlap in (True, False, True, False):
        comm.barrier()
        t = time.perf_counter()
        _c_step(engine, model, docs, rank, world, overlap=overlap)
        _sync(dev)
        times.setdefault(overlap, []).append(time.perf_counter() - t)
    out["step_s_overlapped"], out["step_s_not_overlapped"] = min(times[True]), min(times[False])
    out["memory"] = _memory(dev)
    if rank == 0:
        (out_dir / f"c_world{world}.json").write_text(json.dumps(out, indent=1))
    if oom:
        _c_oom(engine, model, rank, dev)
        print(f"rank {rank} finished after the OOM phase", file=sys.stderr, flush=True)
    del engine, model
    end_distributed()


def _c_oom(engine, model, rank: int, dev: torch.device) -> None:
    """A micro-batch of a loader step (``step`` set) on both ranks, too big for rank 1 only: its
    memory fraction is cut to what it holds (CUDA), or its forward raises the error (CPU)."""
    from dcparallel.data.collate import text_batch
    from dcparallel.loss import per_token_loss
    from dcparallel.plan.types import MicroBatch
    from dcparallel.spec import Layout, Recompute

    n = 256 if dev.type == "cpu" else 16384
    docs = {0: torch.randint(0, 256, (n,))}
    batch = text_batch(MicroBatch((0,), Layout(2, 1, Recompute.none())), (0, 1), rank, docs)
    batch = dataclasses.replace(batch.to(dev), step=7)
    if rank == 1:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated(dev) + 2**20) / total, dev)
        else:

            def boom(*_):
                raise torch.OutOfMemoryError("CPU stand-in for CUDA out of memory")

            model.layers[0].register_forward_pre_hook(boom)
    with engine.micro_batch(batch, last=True) as ctx:
        ptl, _ = per_token_loss(model(batch.inputs, batch.positions), batch.labels)
        ctx.backward(ctx.token_loss(ptl, batch.loss_mask))
    engine.sync_gradients()


# ---------------------------------------------------------------- (d) attention kernels


@dataclasses.dataclass(frozen=True)
class AttnCase:
    """One model family's attention, at the GPU run's sizes (`tiny` gives the dry run's)."""

    name: str
    kind: str
    """``causal`` (text) or ``full`` (video)"""
    heads: int
    kv_heads: int
    head_dim: int
    """query / key head size"""
    value_head_dim: int
    softcap: float | None = None
    window: int | None = None
    sinks: bool = False
    long: bool = True
    """also run on the long documents; False keeps a second FlexAttention case off them (each
    case at each length costs the part a compile or an eager reference of 8192 tokens)"""

    def pattern(self):
        from dcparallel.models.attention import AttnPattern

        return AttnPattern(self.kind, softcap=self.softcap, window=self.window)

    def takes_flex(self) -> bool:
        """Whether a GPU takes FlexAttention for it under this torch (bf16, one packed row)."""
        from dcparallel.models.attention import AttnFeatures, _torch_version, attention_kernel

        features = AttnFeatures(self.kind, self.softcap is not None, self.sinks, self.window is not None)
        return attention_kernel("cuda", torch.bfloat16, features, _torch_version()) == "flex"

    def tiny(self) -> AttnCase:
        """4 query heads, the grouping kept where it fits, head sizes / 8."""
        kv = max(1, 4 * self.kv_heads // self.heads)
        return dataclasses.replace(
            self, heads=4, kv_heads=kv, head_dim=self.head_dim // 8, value_head_dim=self.value_head_dim // 8
        )


#: the window of both window cases: shorter than the short documents, so both layouts mask by it
WINDOW = 48
ATTN_CASES = (
    AttnCase("llama-gqa", "causal", 32, 8, 128, 128),
    AttnCase("mistral-window", "causal", 32, 8, 128, 128, window=WINDOW),
    AttnCase("gpt-oss-sinks-window", "causal", 16, 2, 64, 64, window=WINDOW, sinks=True),
    AttnCase("gemma2-softcap", "causal", 16, 8, 128, 128, softcap=50.0, long=False),
    AttnCase("gpt-oss-sinks", "causal", 16, 2, 64, 64, sinks=True, long=False),
    AttnCase("deepseek-mla", "causal", 16, 16, 192, 128),
    AttnCase("wan-full", "full", 12, 12, 128, 128),
)
#: document lengths of one packed row: (GPU, dry run); each row ends in `ATTN_PAD` padding tokens
ATTN_LAYOUTS = {
    "short_256x64": ([64] * 256, [64] * 6),
    "long_7": ([512, 4096, 1024, 8192, 2048, 300, 700], [37, 300, 20, 150, 64, 9, 90]),
}
ATTN_PAD = 7
#: no case starts past this many seconds of the part (its budget is 45 s): a case with a cold
#: FlexAttention compile may take 10-20 s; what finished is saved before a kill
ATTN_START_LIMIT_S = 25.0


def _attn_order(run: tuple[str, AttnCase]) -> tuple[bool, int]:
    """The kernels varlen_attn and SDPA take first, layout by layout; then FlexAttention's, one
    case on both layouts in a row (the second reuses the compiled kernel: `dynamic=True`)."""
    case = run[1]
    flex = case.takes_flex()
    return flex, [c.name for c in ATTN_CASES].index(case.name) if flex else 0


def _attn_fwd_bwd(fn, inputs: list[torch.Tensor], weight: torch.Tensor, dev: torch.device):
    """One forward + backward of ``fn`` on fresh leaves: the output, every input's gradient
    (fp32), the seconds, and the bytes the call added to what was allocated at its peak."""
    xs = [t.detach().requires_grad_() for t in inputs]
    start = 0
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        start = torch.cuda.memory_allocated(dev)
    t = time.perf_counter()
    out = fn(*xs)
    (out.float() * weight).sum().backward()
    _sync(dev)
    seconds = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated(dev) - start if dev.type == "cuda" else None
    return out.detach().float(), [x.grad.float() for x in xs], seconds, peak


def attn_case(case: AttnCase, docs: list[int], dev: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    """The package's kernel (`cuda_varlen_attention`, as training calls it) against the exact
    per-document reference (`sdpa_attention`) on fp32 copies of the same inputs (fp64 on CPU,
    where the kernel itself runs in fp32): the kernel `attention_kernel` takes, the relative
    error of the output and of each gradient (q, k, v, sinks), the median seconds of a
    forward + backward, and its peak memory. On CPU, a case FlexAttention takes on a GPU
    also runs flex's forward (it has no CPU backward)."""
    from dcparallel.models import attention as attn
    from dcparallel.models.flex import flex_packed

    tokens, cu, pattern = sum(docs) + ATTN_PAD, (0, *itertools.accumulate(docs)), case.pattern()
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [
        (1, tokens, case.heads, case.head_dim),
        (1, tokens, case.kv_heads, case.head_dim),
        (1, tokens, case.kv_heads, case.value_head_dim),
    ] + ([(case.heads,)] if case.sinks else [])
    base = [torch.randn(s, generator=g, device=dev) for s in shapes]
    weight = torch.randn(1, tokens, case.heads, case.value_head_dim, generator=g, device=dev)
    fast = [t.to(dtype) for t in base]
    call = lambda kernel: lambda q, k, v, *s: kernel(q, k, v, pattern, cu, *s)  # noqa: E731
    features = attn.AttnFeatures.of(fast[0], pattern, fast[3] if case.sinks else None)
    row = {
        "kernel": attn.attention_kernel(dev.type, dtype, features, attn._torch_version()),
        "tokens": tokens,
        "documents": len(docs),
        "heads": f"{case.heads}/{case.kv_heads}",
        "head_dims": f"{case.head_dim}/{case.value_head_dim}",
        "window": case.window,
        "dtype": str(dtype),
    }
    ref = [t.to(torch.float64 if dev.type == "cpu" else torch.float32) for t in base]
    ref_out, ref_grads, row["reference_s"], row["reference_peak_bytes"] = _attn_fwd_bwd(
        call(attn.sdpa_attention), ref, weight, dev
    )
    del ref
    times, kernel = [], call(attn.cuda_varlen_attention)
    for _ in range(1 + repeats):  # the first compiles FlexAttention's kernels
        out, grads, seconds, row["kernel_peak_bytes"] = _attn_fwd_bwd(kernel, fast, weight, dev)
        times.append(seconds)
    row["kernel_s"] = sorted(times[1:])[len(times[1:]) // 2]
    row["rel_err_out"] = _rel(out, ref_out)
    for label, a, b in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, strict=False):
        row[f"rel_err_{label}"] = _rel(a, b)
    if dev.type == "cpu" and case.takes_flex():
        with torch.no_grad():
            flex = flex_packed(
                *fast[:3],
                cu,
                causal=pattern.causal,
                softcap=case.softcap,
                window=case.window,
                sinks=fast[3] if case.sinks else None,
            )
        row["flex_forward_rel_err_out"] = _rel(flex, ref_out)
    return row


def part_d(out_dir: Path, dry: bool) -> dict:
    """The attention kernels training takes (varlen_attn, FlexAttention for softcap, sinks and
    windows varlen_attn lacks, the SDPA loop) against the fp32 reference, for each model
    family of `ATTN_CASES` on 256 documents of 64 tokens and on 7 long ones. The cases
    FlexAttention takes run last (`_attn_order`), and none starts past `ATTN_START_LIMIT_S`.
    Alone: ``python benchmarks/tools/device_check_parts.py d --out-dir DIR [--dry-run]``."""
    start = time.perf_counter()
    dev = torch.device("cpu") if dry else torch.device("cuda", 0)
    dtype = torch.float32 if dry else torch.bfloat16
    runs = [
        (layout, case.tiny() if dry else case)
        for layout in ATTN_LAYOUTS
        for case in ATTN_CASES
        if case.long or layout == "short_256x64"
    ]
    runs.sort(key=_attn_order)
    out: dict = {"torch": torch.__version__, **{layout: {} for layout in ATTN_LAYOUTS}}
    for layout, case in runs:
        if time.perf_counter() - start > ATTN_START_LIMIT_S and not dry:
            out[layout][case.name] = {"skipped": f"not started: past {ATTN_START_LIMIT_S:.0f} s of the part"}
            continue
        docs = ATTN_LAYOUTS[layout][1 if dry else 0]
        try:
            out[layout][case.name] = attn_case(case, docs, dev, dtype, repeats=1 if dry else 3)
        except Exception as exc:  # noqa: BLE001 - reported; the other cases still run
            out[layout][case.name] = {"error": _err(exc), "traceback": traceback.format_exc()[-1500:]}
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        save(out_dir, "d", out)
    return out


# ---------------------------------------------------------------- (e) a world-1 NCCL group


def part_e(out_dir: Path, dry: bool) -> dict:
    """A process group of one rank forced on (the launcher makes none at world 1): NCCL bound
    to cuda:0 with ``device_id`` (gloo on CPU in the dry run), a split group, object
    collectives, the control group, and one engine step with the group live."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from dcparallel.runtime import comm

    dev = torch.device("cpu") if dry else torch.device("cuda", 0)
    backend = "gloo" if dry else "nccl"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kw = {"device_id": dev} if backend == "nccl" else {}
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timedelta(seconds=60), **kw
    )
    out: dict = {"backend": dist.get_backend(), "torch": torch.__version__}
    checks = {
        "all_reduce": lambda: _reduced(None, dev),
        "split_group": lambda: (
            _reduced(dist.split_group(split_ranks=[[0]]), dev)
            if hasattr(dist, "split_group")
            else "absent in this torch"
        ),
        "new_group": lambda: _reduced(dist.new_group([0]), dev),
        "all_gather_object": lambda: comm.all_gather_object({"rank": 0}),
        "broadcast_object_list": lambda: _broadcast_objects(),
        "control_group": lambda: str(comm.control_group()) if hasattr(comm, "control_group") else "absent",
        "engine_step": lambda: _engine_step(dev, dry),
    }
    for name, fn in checks.items():
        try:
            out[name] = fn()
        except Exception as exc:  # noqa: BLE001 - each check reports on its own
            out[name] = {"error": _err(exc)}
    dist.destroy_process_group()
    return out


def _reduced(group, dev: torch.device) -> float:
    import torch.distributed as dist

    t = torch.full((4,), 3.0, device=dev)
    dist.all_reduce(t, group=group)
    return float(t.sum())


def _broadcast_objects():
    import torch.distributed as dist

    objs = [{"plan": [1, 2, 3]}]
    dist.broadcast_object_list(objs, src=0)
    return objs[0]


def _engine_step(dev: torch.device, dry: bool) -> dict:
    from dcparallel.runtime.engine import Engine

    model = _c_model(dry, dev)
    engine = Engine(model, layers=model.layers, num_heads=model.cfg.num_heads)
    g = torch.Generator().manual_seed(1)
    docs = {i: torch.randint(0, 256, (n,), generator=g) for i, n in enumerate([37, 120, 64, 9, 200, 50])}
    loss = _c_step(engine, model, docs, 0, 1)
    return {"loss": loss, "grad_norm": float(torch.cat([g.flatten() for g in engine.full_gradients().values()]).norm())}


# ---------------------------------------------------------------- (f) optimizer-step memory


def _live_bytes() -> int:
    """Bytes of every live CPU tensor storage, each storage once."""
    import gc

    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            st = obj.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def part_f(out_dir: Path, dry: bool) -> dict:
    """A 1.3B-parameter Llama in bf16 at world 1 with the engine's ZeRO-1 AdamW: the bytes held
    after ``opt.step()`` against the cost model's states (`cost.base.state_recipe`), and the
    peak of the step (sync, clip and update: torch.cuda.max_memory_allocated) against the
    recipe's step peak; the second step's, when the optimizer's state exists."""
    from dcparallel.cost.base import state_recipe
    from dcparallel.models.llama import Llama, LlamaConfig
    from dcparallel.profile.inputs import reference_spec
    from dcparallel.runtime.engine import Engine

    dev = torch.device("cpu") if dry else torch.device("cuda", 0)
    cfg = (
        LlamaConfig(vocab_size=256, hidden=64, num_layers=2, num_heads=4, ffn_hidden=176)
        if dry
        else LlamaConfig(vocab_size=32000, hidden=2048, num_layers=24, num_heads=16, ffn_hidden=5632)
    )
    torch.manual_seed(0)
    with torch.device(dev):
        model = Llama(cfg).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    recipe = state_recipe(reference_spec(model, model.layers)[0], 1, 1, num_params=n, bytes_per_value=2)
    engine = Engine(model, layers=model.layers, num_heads=cfg.num_heads)
    opt = engine.optimizer(lr=1e-4)
    lengths = [30, 50, 20, 40, 10, 25] if dry else [300, 500, 224, 128, 400, 256]  # (c)'s plan: six documents
    docs = {i: torch.randint(0, cfg.vocab_size, (k,)) for i, k in enumerate(lengths)}
    held = _live_bytes if dev.type == "cpu" else (lambda: torch.cuda.memory_allocated(dev))
    for second in (False, True):  # counted on the second step, when the optimizer's state exists
        _c_micro_batches(engine, model, docs, 0, 1)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        before = held() if second else None  # the activations are freed: what the step starts from
        engine.sync_gradients()
        engine.clip_grad_norm_(1.0)
        opt.step()
        _sync(dev)
        after = held() if second else None
    out: dict = {
        "num_params": n,
        "recipe": dataclasses.asdict(recipe),
        "recipe_states_bytes": recipe.states,
        "recipe_step_peak_bytes": recipe.step_peak,
        "held_before_sync_bytes": before,
        "held_after_step_bytes": after,
        "held_after_vs_recipe_states": after / recipe.states,
    }
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev)
        out |= {"step_peak_bytes": peak, "step_peak_vs_recipe": peak / recipe.step_peak, "memory": _memory(dev)}
    out["bytes_per_param"] = {k: v / n for k, v in out.items() if k.endswith("_bytes")}
    return out


# ---------------------------------------------------------------- (g) the sharded runtime

ONE_GPU = "skipped: sharding needs ≥ 2 GPUs in a node (one GPU lent)"
NO_GPU = (
    "skipped: sharding needs ≥ 2 GPUs in a node (dry run on CPU; `torchrun --nproc-per-node 2 "
    "benchmarks/tools/sharded_device_check.py --dry-run --out r.json` runs its code on gloo)"
)


def part_g(out_dir: Path, dry: bool) -> dict:
    """The sharded runtime with shard size = the node's GPUs (benchmarks/tools/sharded_device_check.py)."""
    gpus = 0 if dry else torch.cuda.device_count()
    if gpus < 2:
        return {"skipped": ONE_GPU if gpus == 1 else NO_GPU, "gpus": gpus}
    result = out_dir / "sharded_device_check.json"
    r = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={gpus}",
            str(TOOLS / "sharded_device_check.py"),
            "--out",
            str(result),
        ],
        timeout=300,
    )
    if r.returncode != 0 or not result.exists():
        raise RuntimeError(f"sharded_device_check.py failed ({r.returncode}): {r.stderr[-2000:]}")
    return {"gpus": gpus, **json.loads(result.read_text())}


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e, "f": part_f, "g": part_g}


def run_parts(keys: list[str], out_dir: Path, dry: bool) -> int:
    """Parts ``keys`` one after the other in this process, each result saved with its seconds
    (``part_seconds``) or, where the part raised, its traceback (``part_error``) and what it had
    saved; the next part still runs. 1 if any part raised."""
    failed = 0
    for key in keys:
        t = time.perf_counter()
        try:
            result = PARTS[key](out_dir, dry) | {"part_seconds": time.perf_counter() - t}
        except Exception:  # noqa: BLE001 - reported in the part's result; the other parts still run
            traceback.print_exc()
            saved = out_dir / f"part_{key}.json"
            partial = json.loads(saved.read_text()) if saved.exists() else None
            result = {"part_error": traceback.format_exc()[-2500:], "part_seconds": time.perf_counter() - t}
            result["partial"], failed = partial, 1
        save(out_dir, key, result)
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", help=f"one of {', '.join([*PARTS, 'b-train', 'c-rank'])}, or parts comma-separated")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--model", choices=list(MODELS_B), help="b-train: which model")
    ap.add_argument("--oom", action="store_true", help="c-rank: end in an out-of-memory error on rank 1")
    args = ap.parse_args(argv)
    if args.dry_run:
        torch.set_num_threads(1)
    if args.part == "c-rank":
        rank_c(args.out_dir, args.dry_run, args.oom)
        return 0
    if args.part == "b-train":
        res = train_one(args.out_dir, args.dry_run, args.model)
        (args.out_dir / f"train_{args.model}.json").write_text(json.dumps(res, indent=1))
        return 0
    keys = args.part.split(",")
    if not set(keys) <= set(PARTS):
        ap.error(f"unknown part(s) {sorted(set(keys) - set(PARTS))}")
    return run_parts(keys, args.out_dir, args.dry_run)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
