"""The H200 device check (issue 11): one script, under 8 minutes on one GPU, a dated report
into the folder it is given (the device tool's $OUT).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/device_check.py --out-dir "$OUT"
    PYTHONPATH=. python3 benchmarks/device_check.py --dry-run --out-dir /tmp/dc   # CPU, tiny sizes

(a) `profile --validate` of the Llama-7B-like stack (8 layers) and the ~1.1B video DiT (6
    pairs), bf16: extrapolation error of time and memory (benchmarks/profile_device_check.py,
    run as a subprocess with its own time budget);
(b) `varlen_attn` packed causal attention vs the loop of SDPA per document, forward and
    backward: max error and time;
(c) a few training steps at world 1 (`dcparallel train`) of the reference LM, a transformers
    Llama with grouped-query attention and a diffusers Wan transformer: planned vs measured
    step compute time and peak memory;
(d) PAC on short data: a micro-batch of short documents with no recompute (what PAC plans when
    memory allows) vs full recompute: measured speedup;
(e) the parameter-sharded runtime (FSDP2 in a block of all the node's GPUs,
    benchmarks/sharded_device_check.py under torchrun): parity with the replicated engine,
    parameter + gradient storage per rank, step time and peak memory. It needs two GPUs or
    more in the node: with one GPU lent (or in the dry run) the report says it was skipped.

Each part runs in a try block; a failure is written into the report and the rest still runs.
``--dry-run`` runs the same code on CPU with tiny sizes: it checks the script, not the numbers.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import functools
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def part_a(out_dir: Path, dry: bool, budget_s: float) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "profile_device_check.py"), "--out-dir", str(out_dir),
           "--budget-s", str(budget_s)] + (["--dry-run"] if dry else [])
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget_s + 120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    reports = sorted(out_dir.glob("profile-device_*.md"))
    return {"returncode": r.returncode, "report": reports[-1].name if reports else None,
            "tail": (r.stdout + r.stderr)[-1500:], "table": reports[-1].read_text() if reports else ""}


def part_b(device: torch.device, dry: bool) -> dict:
    import torch.nn.functional as F

    heads, dim = (4, 16) if dry else (32, 128)
    docs = [37, 120, 64, 9] if dry else [512, 4096, 1024, 8192, 2048, 300, 700]
    dtype = torch.float32 if dry else torch.bfloat16
    total = sum(docs)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, heads, dim, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32, device=device)

    def loop():
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            x = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]  # (1, H, L, D): the fast 4-D kernel
            outs.append(F.scaled_dot_product_attention(*x, is_causal=True)[0].transpose(0, 1))
        return torch.cat(outs)

    grad = torch.randn(total, heads, dim, generator=g).to(device, dtype)
    out = {"tokens": total, "documents": len(docs), "heads": heads, "head_dim": dim, "dtype": str(dtype)}

    def fwd_bwd(f):
        def run():
            for t in (q, k, v):
                t.grad = None
            f().backward(grad)
        return run

    ref = loop()
    ref.backward(grad)
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    out["sdpa_loop_fwd_s"] = _time(lambda: loop(), device, 3)
    out["sdpa_loop_fwd_bwd_s"] = _time(fwd_bwd(loop), device, 3)
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        mx = max(docs)
        # causal: is_causal=True in torch 2.9-2.10, window_size=(-1, 0) from 2.11 on
        causal = {"is_causal": True} if "is_causal" in inspect.signature(varlen_attn).parameters else \
            {"window_size": (-1, 0)}

        def var():
            return varlen_attn(q, k, v, cu, cu, mx, mx, **causal)

        got = var()
        got.backward(grad)
        out["varlen_max_abs_err_out"] = (got.float() - ref.float()).abs().max().item()
        out["varlen_max_abs_err_grad"] = max((t.grad.float() - r.float()).abs().max().item()
                                             for t, r in zip((q, k, v), ref_grads, strict=True))
        out["varlen_fwd_s"] = _time(lambda: var(), device, 3)
        out["varlen_fwd_bwd_s"] = _time(fwd_bwd(var), device, 3)
        out["speedup_fwd_bwd"] = out["sdpa_loop_fwd_bwd_s"] / out["varlen_fwd_bwd_s"]
    except Exception as exc:  # noqa: BLE001 - GPU-only kernel: reported, not fatal
        out["varlen_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return out


#: the model-adapter families trained in (c) besides the reference LM: [model] TOML lines (dry run, GPU)
FAMILIES = {
    "transformers": ('family = "transformers"\narchitecture = "LlamaForCausalLM"\n[model.config]\n'
                     'vocab_size = 256\n'
                     'hidden_size = 64\nintermediate_size = 128\nnum_hidden_layers = 2\nnum_attention_heads = 8\n'
                     'num_key_value_heads = 2\n',
                     'family = "transformers"\narchitecture = "LlamaForCausalLM"\n[model.config]\n'
                     'vocab_size = 32000\n'
                     'hidden_size = 2048\nintermediate_size = 8192\nnum_hidden_layers = 8\nnum_attention_heads = 32\n'
                     'num_key_value_heads = 8\nmax_position_embeddings = 32768\n'),
    "diffusers": ('family = "diffusers"\narchitecture = "WanTransformer3DModel"\n[model.config]\n'
                  'patch_size = [1, 2, 2]\n'
                  'num_attention_heads = 4\nattention_head_dim = 8\nin_channels = 4\nout_channels = 4\n'
                  'text_dim = 16\nfreq_dim = 16\nffn_dim = 32\nnum_layers = 2\nrope_max_seq_len = 32\n',
                  'family = "diffusers"\narchitecture = "WanTransformer3DModel"\n[model.config]\n'
                  'patch_size = [1, 2, 2]\n'
                  'num_attention_heads = 12\nattention_head_dim = 128\nin_channels = 16\nout_channels = 16\n'
                  'text_dim = 4096\nfreq_dim = 256\nffn_dim = 8960\nnum_layers = 8\n'),
}


def _train_steps(out_dir: Path, name: str, model_toml: str, data_toml: str, tokens_per_step: int, steps: int,
                 max_tokens: int, cost: str = "profiled", min_time_s: float = 0.2, max_repeats: int = 12) -> list[dict]:
    run_dir = out_dir / f"train_{name}"
    config = out_dir / f"train_{name}.toml"
    config.write_text(f"[data]\n{data_toml}[train]\npolicy = \"dcp\"\ntokens_per_step = {tokens_per_step}\n"
                      f"max_steps = {steps}\nout_dir = \"{run_dir}\"\n[profile]\nrepeats = 1\n"
                      f"max_repeats = {max_repeats}\nmin_time_s = {min_time_s}\nmax_mbs = 4\n"
                      f"max_tokens = {max_tokens}\ncost = \"{cost}\"\n[model]\n{model_toml}")
    r = subprocess.run([sys.executable, "-m", "dcparallel", "train", "--config", str(config)], cwd=ROOT,
                       capture_output=True, text=True, timeout=400,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    if r.returncode != 0:
        raise RuntimeError(f"train {name} failed ({r.returncode}): {r.stderr[-1500:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: x.get(k) for k in ("global_step", "step_s", "planned_compute_s", "planned_peak_memory_bytes",
                                   "measured_peak_memory_bytes", "loss")} for x in rows]


def part_c(out_dir: Path, dry: bool) -> dict:
    """Training steps at world 1: the reference LM, a transformers Llama (GQA) and a diffusers
    Wan through `dcparallel train`; planned vs measured step time and peak memory."""
    lengths = out_dir / "lengths_c.txt"
    lengths.write_text("\n".join(str(n) for n in ([24, 40, 64, 100, 180, 30] * 4 if dry else
                                                   [512, 2048, 8192, 1024, 300, 4096, 700, 16384] * 4)) + "\n")
    model = ("hidden = 64\nnum_layers = 2\nnum_heads = 4\nffn_hidden = 176\nvocab_size = 256\n" if dry else
             "hidden = 2048\nnum_layers = 8\nnum_heads = 16\nffn_hidden = 5632\nvocab_size = 32000\n")
    text_data = f'lengths = "{lengths}"\n'
    budget, steps, cap = (700, 3, 512) if dry else (32768, 6, 16384)
    # the dry run times each layout once (it checks the code); on the GPU short layouts get more runs
    runs = {"steps": lambda: _train_steps(out_dir, "c", model, text_data, budget, steps, cap,
                                          min_time_s=0.0 if dry else 0.2, max_repeats=1 if dry else 12)}
    for family, (tiny, big) in FAMILIES.items():
        text = family == "transformers"
        data = text_data if text else 'lengths = "builtin"\nnum_samples = 24\ntext_tokens = 8\n'
        tokens = budget if text else (300 if dry else 4000)
        # the dry run plans them analytically (the profiled path is the reference LM's)
        runs[family] = functools.partial(_train_steps, out_dir, family, tiny if dry else big, data, tokens, steps,
                                         cap, "analytic" if dry else "profiled")
    # on the GPU one run at a time (they time the device); the dry run checks the code, so its
    # single-threaded CPU runs go side by side
    with concurrent.futures.ThreadPoolExecutor(len(runs) if dry else 1) as pool:
        futures = {name: pool.submit(fn) for name, fn in runs.items()}
    out = {"steps": futures.pop("steps").result()}
    errors = {}
    for family, f in futures.items():
        try:
            out[family] = f.result()
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # reported; the other parts still run
            errors[family] = str(exc)[-1500:]
    if errors:
        out["errors"] = errors
    return out


def part_d(device: torch.device, dry: bool) -> dict:
    from dcparallel.data.collate import text_batch
    from dcparallel.loss import per_token_loss
    from dcparallel.models.llama import Llama, LlamaConfig
    from dcparallel.plan.types import MicroBatch
    from dcparallel.runtime.engine import Engine
    from dcparallel.spec import Layout, Recompute

    dtype = torch.float32 if dry else torch.bfloat16
    cfg = (LlamaConfig(vocab_size=256, hidden=64, num_layers=2, num_heads=4, ffn_hidden=176) if dry else
           LlamaConfig(vocab_size=32000, hidden=4096, num_layers=8, num_heads=32, ffn_hidden=11008))
    torch.manual_seed(0)
    model = Llama(cfg).to(device, dtype)
    dc = Engine(model, layers=model.layers, num_heads=cfg.num_heads)
    n_docs, length = (4, 64) if dry else (16, 512)
    docs = {i: torch.randint(0, cfg.vocab_size, (length,)) for i in range(n_docs)}
    out = {"documents": n_docs, "doc_tokens": length, "num_layers": cfg.num_layers}
    for name, rc in (("none", Recompute.none()), ("full", Recompute.full(cfg.num_layers))):
        batch = text_batch(MicroBatch(tuple(range(n_docs)), Layout(1, n_docs, rc)), (0,), 0, docs).to(device)

        def step(batch=batch):
            with dc.micro_batch(batch) as ctx:
                ptl, _ = per_token_loss(model(batch.inputs, batch.positions), batch.labels)
                ctx.backward(ctx.token_loss(ptl, batch.loss_mask))
            dc.zero_grad()

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        out[f"{name}_s"] = _time(step, device, 3)
        if device.type == "cuda":
            out[f"{name}_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    out["speedup_no_recompute"] = out["full_s"] / out["none_s"]
    return out


#: what part (e) says when it cannot run
ONE_GPU = "skipped: sharding needs ≥ 2 GPUs in a node (one GPU lent)"
NO_GPU = ("skipped: sharding needs ≥ 2 GPUs in a node (dry run on CPU; `torchrun --nproc-per-node 2 "
          "benchmarks/sharded_device_check.py --dry-run --out r.json` runs its code on gloo)")


def part_e(out_dir: Path, dry: bool) -> dict:
    """The sharded runtime with shard size = the node's GPUs (benchmarks/sharded_device_check.py)."""
    gpus = 0 if dry else torch.cuda.device_count()
    if gpus < 2:
        return {"skipped": ONE_GPU if gpus == 1 else NO_GPU, "gpus": gpus}
    result = out_dir / "sharded_device_check.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}",
           str(ROOT / "benchmarks" / "sharded_device_check.py"), "--out", str(result)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    if r.returncode != 0 or not result.exists():
        raise RuntimeError(f"sharded_device_check.py failed ({r.returncode}): {r.stderr[-2000:]}")
    return {"gpus": gpus, **json.loads(result.read_text())}


def write(out_dir: Path, meta: dict, results: dict) -> Path:
    path = out_dir / f"device-check_{meta['hardware']}_{meta['date']}.md"
    lines = [f"# Device check — {meta['device_name']} — {meta['date']}", "",
             f"Command: `{meta['command']}`; torch {meta['torch']}, Python {meta['python']}; "
             f"{'DRY RUN on CPU with tiny sizes: checks the script, not the numbers' if meta['dry'] else 'GPU run'}; "
             f"{meta['seconds']:.0f} s.", ""]
    for key, title in (("a", "(a) profile --validate"), ("b", "(b) varlen_attn vs SDPA loop"),
                       ("c", "(c) training steps at world 1"), ("d", "(d) PAC on short data"),
                       ("e", "(e) sharded runtime (FSDP2 blocks)")):
        lines += [f"## {title}", ""]
        res = results.get(key)
        if res is None:
            lines += ["not run", ""]
        elif "error" in res:
            lines += ["FAILED:", "", "```", res["error"], "```", ""]
        elif "skipped" in res:
            lines += [res["skipped"], ""]
        elif key == "a":
            lines += [f"profile_device_check.py exit {res['returncode']}, report `{res['report']}`:", "",
                      res["table"] or "```\n" + res["tail"] + "\n```", ""]
        else:
            lines += ["```json", json.dumps(res, indent=1), "```", ""]
    path.write_text("\n".join(lines) + "\n")
    (out_dir / f"device-check_{meta['hardware']}_{meta['date']}.json").write_text(json.dumps(results, indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--budget-a-s", type=float, default=240.0, help="time budget of part (a)")
    ap.add_argument("--parts", default="abcde")
    args = ap.parse_args(argv)
    dry = args.dry_run
    device = torch.device("cpu") if dry or not torch.cuda.is_available() else torch.device("cuda", 0)
    if not dry and device.type != "cuda":
        raise SystemExit("no CUDA device: run with --dry-run on CPU")
    torch.set_num_threads(1 if dry else torch.get_num_threads())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    meta = {"date": dt.date.today().isoformat(), "hardware": "h200" if "H200" in name else ("cpu" if dry else
            name.lower().replace(" ", "-")), "device_name": name, "dry": dry, "torch": torch.__version__,
            "python": platform.python_version(), "command": " ".join(["benchmarks/device_check.py", *(argv or
                                                                                               sys.argv[1:])])}
    results: dict = {}
    parts = {"a": lambda: part_a(args.out_dir, dry, 60.0 if dry else args.budget_a_s),
             "b": lambda: part_b(device, dry), "c": lambda: part_c(args.out_dir, dry), "d": lambda: part_d(device, dry),
             "e": lambda: part_e(args.out_dir, dry)}
    for key in args.parts:
        print(f"[device_check] part ({key}) ...", file=sys.stderr, flush=True)
        try:
            results[key] = parts[key]()
        except Exception:  # noqa: BLE001 - one part's failure is reported, the rest still runs
            results[key] = {"error": traceback.format_exc()[-3000:]}
        meta["seconds"] = time.perf_counter() - t0
        path = write(args.out_dir, meta, results)  # rewritten after each part: a cut-short run keeps what it has
    print(path)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
