"""Local models, tokenizers and datasets for the fine-tuning tests, built offline: a
word-level tokenizer trained on the tests' own text with a ChatML-like chat template, tiny
transformers / diffusers models saved with ``save_pretrained``, chat JSONL files and a
manifest of latent files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

SPECIALS = ["<unk>", "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
#: the same rendering with transformers' {% generation %} markers around assistant turns
GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WORDS = ("red green blue cyan pink gold gray black white one two three four five six seven eight nine "
         "what is the color of sky grass sun snow coal count after before say repeat please word next").split()


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
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = template
    return fast


def llama_dir(path: Path, vocab_size: int, seed: int = 0) -> Path:
    """A tiny LlamaForCausalLM (fp32) and the test tokenizer saved to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, torch_dtype="float32")
    LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


WAN_CONFIG = {"patch_size": [1, 2, 2], "num_attention_heads": 4, "attention_head_dim": 8, "in_channels": 4,
              "out_channels": 4, "text_dim": 16, "freq_dim": 16, "ffn_dim": 32, "num_layers": 2,
              "rope_max_seq_len": 32}


def wan_dir(path: Path, seed: int = 0) -> Path:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    WanTransformer3DModel(**WAN_CONFIG).save_pretrained(path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def latents_manifest(root: Path, shapes: list[tuple[int, int, int]], *, text_tokens: int = 4, channels: int = 4,
                     text_dim: int = 16, fmt: str = "safetensors", seed: int = 0) -> Path:
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
        rows.append({"latents": f"lat{i}.{fmt}", "text_embeddings": f"txt{i}.{fmt}", "frames": f, "height": h,
                     "width": w})
    return write_jsonl(root / "manifest.jsonl", rows)
