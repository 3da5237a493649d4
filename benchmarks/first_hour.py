"""The first hour of a new user (`first-hour_cpu_2026-12-06.md`): a corpus they did not write
(a Python standard library's top-level files as a text JSONL under the field "content"), a
byte-level BPE tokenizer trained on it offline, a tiny transformers Llama saved beside it, the
TOML of `dcparallel train` and the user's own loop with the README's lines, all in ``OUT``.

    .venv/bin/python benchmarks/first_hour.py OUT [/usr/lib/python3.11]   # then the commands it prints
    .venv/bin/python benchmarks/first_hour.py OUT --generated   # 767 log-normal files cut from it instead
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

TOML = """[model]
pretrained = "{out}/tiny-llama"
[data]
path = "{out}/stdlib.jsonl"
format = "text"
field = "content"
max_tokens = 4096
eval_fraction = 0.05
[train]
tokens_per_step = 32768
max_steps = 8
lr = 1e-3
warmup_steps = 2
schedule = "cosine"
out_dir = "{out}/run"
eval_every = 4
"""

#: files of the generated corpus (``--generated``)
GENERATED_FILES = 767

LOOP = """import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from dcparallel.data import text_dataset

torch.set_num_threads(1)
model = LlamaForCausalLM.from_pretrained("{out}/tiny-llama", attn_implementation="sdpa")
tokenizer = AutoTokenizer.from_pretrained("{out}/tiny-llama")
dataset, lengths = text_dataset("{out}/stdlib.jsonl", tokenizer, field="content", max_tokens=4096)

import dcparallel

def loss_fn(model, batch, ctx):
    logits = model(input_ids=batch.inputs, position_ids=batch.positions, use_cache=False).logits
    return ctx.lm_loss(logits)

dc = dcparallel.DataCentricParallel(model, policy="dcp")
loader = dc.prepare(dataset, lengths=lengths, tokens_per_step=32768, loss_fn=loss_fn,
                    profile_path="{out}/run/profile.json")
opt = dc.optimizer(lr=1e-3)
for step in loader:
    for batch in step:
        with dc.micro_batch(batch) as ctx:
            ctx.backward(loss_fn(model, batch, ctx))
    loss = dc.sync_gradients()
    opt.step()
    if dc.rank == 0:
        print(f"step {{step.index}}: loss {{loss:.3f}}", flush=True)
    if step.index == 3:
        break
"""


def generated_rows(corpus: str, count: int = GENERATED_FILES, seed: int = 0) -> list[dict]:
    """``count`` code-like files cut from ``corpus``'s source lines (the library's files end to
    end, from a random line), log-normal in length: about 67 to 191k tokens at 3.5 characters
    a token, as the corpus of issue 58 was."""
    rng = random.Random(seed)
    files = sorted(Path(corpus).rglob("*.py"))[:2000]
    lines = [x for f in files for x in f.read_text(errors="replace").splitlines(True)]
    rows = []
    for _ in range(count):
        tokens = min(191_000, max(67, int(rng.lognormvariate(7.3, 1.5))))
        start, text = rng.randrange(len(lines)), []
        size = 0
        while size < 3.5 * tokens:
            text.append(lines[start % len(lines)])
            size, start = size + len(text[-1]), start + 1
        rows.append({"content": "".join(text)})
    return rows


def main(out: Path, corpus: str = "/usr/lib/python3.11", generated: bool = False) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    t = time.time()
    out.mkdir(parents=True, exist_ok=True)
    if generated:
        rows = generated_rows(corpus)
    else:
        rows = [{"content": f.read_text(errors="replace")} for f in sorted(Path(corpus).glob("*.py"))]
    (out / "stdlib.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(
        (r["content"] for r in rows), trainers.BpeTrainer(vocab_size=2048, special_tokens=["<unk>", "<s>", "</s>"])
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    cfg = LlamaConfig(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).save_pretrained(out / "tiny-llama")
    fast.save_pretrained(out / "tiny-llama")
    (out / "run.toml").write_text(TOML.format(out=out))
    (out / "ten_lines.py").write_text(LOOP.format(out=out))
    print(
        f"{len(rows)} files, {time.time() - t:.0f} s. Then:\n"
        f"  .venv/bin/python -m dcparallel train --check --config {out}/run.toml\n"
        f"  .venv/bin/torchrun --standalone --nproc-per-node 2 -m dcparallel train --config {out}/run.toml\n"
        f"  .venv/bin/torchrun --standalone --nproc-per-node 2 {out}/ten_lines.py"
    )


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--generated"]
    main(Path(args[0]).resolve(), *args[1:2], generated="--generated" in sys.argv)
