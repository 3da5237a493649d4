"""Local models, tokenizers and datasets for the fine-tuning tests, built offline: a
word-level tokenizer over the tests' own words with a ChatML-like chat template, tiny
transformers / diffusers models saved with ``save_pretrained``, chat JSONL files and a
manifest of latent files."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import torch

from dcparallel.runtime.sharded_checkpoint import read_model
from tests.torchrun_launch import write_config  # noqa: F401  (re-exported)

SPECIALS = ["<unk>", "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: the same rendering with transformers' {% generation %} markers around assistant turns
GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WORDS = (
    "red green blue cyan pink gold gray black white one two three four five six seven eight nine "
    "what is the color of sky grass sun snow coal count after before say repeat please word next"
).split()


def conversations(n: int, seed: int = 0) -> list[dict]:
    """Small deterministic chats a tiny model can learn: the assistant repeats the user's words
    in reverse order (sometimes over two user/assistant rounds, sometimes with a system line)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": "repeat please"}] if rng.random() < 0.3 else []
        for _ in range(rng.choice([1, 1, 2])):
            words = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))]
            msgs.append({"role": "user", "content": " ".join(words)})
            msgs.append({"role": "assistant", "content": " ".join(reversed(words))})
        out.append({"messages": msgs})
    return out


def tokenizer(template: str = CHAT_TEMPLATE):
    """A fast word-level tokenizer over `WORDS` + roles, with `SPECIALS` and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + sorted(set(WORDS) | {"system", "user", "assistant"}))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = template
    return fast


def tiny_llama(vocab_size: int, seed: int = 0, **config: Any):
    """A tiny LlamaForCausalLM (2 layers, 4 heads, 2 KV heads, 128 positions unless ``config``
    says otherwise) seeded by ``seed``, with SDPA attention, in memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        **{
            "vocab_size": vocab_size,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
            "tie_word_embeddings": False,
        }
        | config
    )
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def llama_dir(path: Path, vocab_size: int, seed: int = 0) -> Path:
    """A tiny LlamaForCausalLM (fp32, 256 positions) and the test tokenizer saved to ``path``."""
    model = tiny_llama(vocab_size, seed, max_position_embeddings=256, torch_dtype="float32")
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


WAN_CONFIG = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 4,
    "attention_head_dim": 8,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 16,
    "freq_dim": 16,
    "ffn_dim": 32,
    "num_layers": 2,
    "rope_max_seq_len": 32,
}


def wan_dir(path: Path, seed: int = 0) -> Path:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    WanTransformer3DModel(**WAN_CONFIG).save_pretrained(path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def latents_manifest(
    root: Path,
    shapes: list[tuple[int, int, int]],
    *,
    text_tokens: int = 4,
    channels: int = 4,
    text_dim: int = 16,
    fmt: str = "safetensors",
    seed: int = 0,
) -> Path:
    """Latent files (C, F, H, W) and text embeddings (T, text_dim) per clip, and a JSONL
    manifest naming them (paths relative to the manifest) with frames / height / width."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, (f, h, w) in enumerate(shapes):
        t, y, x = torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij")
        lat = torch.sin(0.7 * x + 0.5 * y + 0.9 * t + i)[None].expand(channels, f, h, w).contiguous()
        lat = lat + 0.1 * torch.randn(channels, f, h, w, generator=g)
        text = torch.randn(text_tokens, text_dim, generator=g)
        for name, tensor in (("lat", lat), ("txt", text)):
            if fmt == "safetensors":
                save_file({"latents" if name == "lat" else "text_embeddings": tensor}, root / f"{name}{i}.safetensors")
            else:
                torch.save(tensor, root / f"{name}{i}.pt")
        rows.append(
            {"latents": f"lat{i}.{fmt}", "text_embeddings": f"txt{i}.{fmt}", "frames": f, "height": h, "width": w}
        )
    return write_jsonl(root / "manifest.jsonl", rows)


def chat_run(root: Path, *, world: int, wandb: bool = False) -> Path:
    """A local Llama + tokenizer, a chat JSONL of 40 conversations and the TOML that fine-tunes
    it (warmup + cosine, clipping, eval split, TensorBoard, export); the config's path."""
    model = llama_dir(root / "model", len(tokenizer()))
    chat = write_jsonl(root / "chat.jsonl", conversations(40, seed=0))
    return write_config(
        root / "run.toml",
        model={"pretrained": model},
        data={"path": chat, "format": "chat", "max_tokens": 64, "eval_fraction": 0.1},
        train={
            "tokens_per_step": 300 * world,
            "epochs": 3,
            "lr": 0.01,
            "warmup_steps": 2,
            "schedule": "cosine",
            "max_grad_norm": 1.0,
            "eval_every": 3,
            "out_dir": root / "run",
            "export_dir": root / "final",
        },
        log={"tensorboard": True, "wandb": wandb},
        profile={"cost": "analytic"},
    )


def wan_run(root: Path, *, copies: int, tokens_per_step: int, schedule: str) -> Path:
    """A local Wan transformer, a manifest of ``copies`` x 4 latent clips of mixed shapes and
    the TOML that fine-tunes it (warmup + ``schedule``, clipping, eval split, TensorBoard,
    W&B offline, analytic cost); the config's path."""
    wan_dir(root / "wan")
    manifest = latents_manifest(root, [(1, 4, 4), (2, 4, 4), (1, 4, 6), (2, 4, 6)] * copies)
    return write_config(
        root / "run.toml",
        model={"pretrained": root / "wan"},
        data={"path": manifest, "eval_fraction": 0.2},
        train={
            "tokens_per_step": tokens_per_step,
            "epochs": 3,
            "lr": 0.003,
            "warmup_steps": 1,
            "schedule": schedule,
            "max_grad_norm": 0.5,
            "eval_every": 2,
            "out_dir": root / "run",
        },
        log={"tensorboard": True, "wandb": True},
        profile={"cost": "analytic"},
    )


def check_chat_run(root: Path, max_grad_norm: float = 1.0) -> list[dict]:
    """What a finished `chat_run` must have left: falling loss, the schedule's lr, clipped
    steps, eval losses, TensorBoard events equal to the metrics, an export that loads and
    holds the trained weights. Returns the metrics rows."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dcparallel.apps.train_setup import lr_lambda

    run = root / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    n = len(rows)
    assert n >= 6 and [r["global_step"] for r in rows] == list(range(1, n + 1))
    losses = [r["loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses  # the training loss falls
    factor = lr_lambda(2, n, "cosine")
    assert [r["lr"] for r in rows] == [0.01 * factor(s) for s in range(n)]
    assert any(r["grad_norm"] > max_grad_norm for r in rows)  # clipping was active on some step
    evals = {r["global_step"]: r["eval_loss"] for r in rows if r["eval_loss"] is not None}
    assert set(evals) == {s for s in range(1, n + 1) if s % 3 == 0 or s == n}
    assert all(math.isfinite(v) for v in evals.values()) and evals[n] < evals[min(evals)]

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    tb = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in tb] == list(range(1, n + 1))
    assert [v for _, v in tb] == [pytest_approx(x) for x in losses]
    assert [e.step for e in acc.Scalars("eval/loss")] == sorted(evals)

    initial = AutoModelForCausalLM.from_pretrained(root / "model", local_files_only=True).eval()
    exported = AutoModelForCausalLM.from_pretrained(root / "final", local_files_only=True).eval()
    trained = AutoModelForCausalLM.from_pretrained(root / "model", local_files_only=True).eval()
    last = sorted((run / "checkpoint").glob("step_*"))[-1]
    missing, unexpected = trained.load_state_dict(read_model(last), strict=False)  # the engine's trained weights
    assert not unexpected and not set(missing) & set(dict(trained.named_parameters())), (missing, unexpected)
    tok = AutoTokenizer.from_pretrained(root / "final", local_files_only=True)
    ids = torch.tensor(
        [tok.apply_chat_template(conversations(1, seed=9)[0]["messages"], tokenize=True, return_dict=True)["input_ids"]]
    )
    with torch.no_grad():
        a, b, c = (m(input_ids=ids).logits for m in (initial, exported, trained))
    assert (a - b).abs().max() > 1e-2  # fine-tuned
    torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-5)  # fp32: the same weights

    # the last eval (after the last update) equals the exported model's mean loss over the eval
    # split's assistant targets, computed one conversation at a time in this process
    from dcparallel.apps.train_config import Config
    from dcparallel.apps.train_setup import read_data

    data = read_data(Config.load(root / "run.toml"), exported, tok, [])
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(data.eval)):
            item = data.eval[i]
            logits = exported(input_ids=item["input_ids"][None]).logits[0]
            m = item["labels"] != -100
            total += float(torch.nn.functional.cross_entropy(logits[m], item["labels"][m], reduction="sum"))
            count += int(m.sum())
    assert evals[n] == pytest_approx(total / count, rel=1e-5)
    return rows


def pytest_approx(x: float, rel: float = 1e-6):
    import pytest

    return pytest.approx(x, rel=rel)  # TensorBoard stores float32


def trainer_reference_steps(
    ref,
    data,
    *,
    seed: int = 0,
    tokens_per_step: int,
    steps: int = 3,
    autocast: bool = False,
    lr: float = 0.01,
    warmup_steps: int = 1,
    weight_decay: float = 0.01,
    max_grad_norm: float = 0.5,
) -> list[float]:
    """dcparallel's own loop (the README's) with what the Trainer tests give the Trainer:
    AdamW (torch's betas and epsilon) at ``lr`` and ``weight_decay``, the linear schedule with
    ``warmup_steps``, clipping at ``max_grad_norm``, on `prepare`'s planned steps of ``data``
    (rows of ``input_ids`` and next-token ``labels``) with ``seed``. Returns the first
    ``steps`` step losses; ``ref`` is trained in place. ``autocast``: each forward under CPU
    autocast to bfloat16, as the Trainer's ``bf16=True``."""
    import contextlib

    from transformers import get_scheduler

    import dcparallel

    dc = dcparallel.DataCentricParallel(ref, seed=seed)
    loader = dc.prepare(
        data, lengths=[len(d["input_ids"]) for d in data], tokens_per_step=tokens_per_step, cost="analytic"
    )
    opt = dc.optimizer(lr=lr, weight_decay=weight_decay)
    sched = get_scheduler("linear", opt, num_warmup_steps=warmup_steps, num_training_steps=steps)
    losses = []
    for step in list(loader)[:steps]:
        for batch in step:
            with dc.micro_batch(batch) as ctx:
                with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
                    loss = dc.loss_fn(ref, batch, ctx)
                ctx.backward(loss)
        losses.append(dc.sync_gradients())
        dc.clip_grad_norm_(max_grad_norm)
        opt.step()
        sched.step()
    return losses


def readme_block(call: str) -> str:
    """The README's ```python block that holds ``call``."""
    import re

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if call in b)


def analytic_arguments(monkeypatch) -> None:
    """`DataCentricArguments` as the README's blocks import it, with cost="analytic" (no
    profiling in these tests; the profiled cost: tests/unit/test_profile*)."""
    import functools

    from dcparallel.integrations import hf_trainer

    monkeypatch.setattr(
        hf_trainer, "DataCentricArguments", functools.partial(hf_trainer.DataCentricArguments, cost="analytic")
    )
