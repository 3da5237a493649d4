"""Text datasets from files: plain text (the whole sequence is the target) or chat
conversations rendered with the tokenizer's chat template (the loss on assistant turns only).

    dataset, lengths = text_dataset("chat.jsonl", tokenizer, format="chat", max_tokens=4096)
    loader = dc.prepare(dataset, lengths=lengths, tokens_per_step=2**16)

Items are ``{"input_ids": (L,) int64}`` (format "text": `collate_text` shifts the labels) or
``{"input_ids", "labels"}`` (format "chat": ``labels[t]`` is the next token ``input_ids[t+1]``
where that token belongs to an assistant turn, else ``IGNORE_INDEX``), so the step's
normalizer counts assistant targets only.

The assistant tokens are found exactly from the template itself: for each assistant message
i, the text it adds is what ``messages[:i+1]`` renders beyond ``messages[:i]`` rendered with
the generation prompt (the template must render each conversation as a prefix of its
continuation; one that does not is refused); the whole conversation is then tokenized once
with character offsets, and a token is an assistant token when its characters overlap such
a span (the rule of transformers' ``return_assistant_tokens_mask``).

Lengths: every sample's token count is computed once (a process pool for large files) and
cached beside the data in ``<file>.lengths-<key>.json``, the key a hash of the file's bytes,
the tokenizer (vocabulary, merges, special tokens, chat template) and these settings; a
sample that is bad (no field, empty, not a conversation, too long with ``truncate=False``)
is named with its file and line (`readers.BadData`).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import multiprocessing
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dcparallel.data.readers import BadData, Row, content_hash, read_rows
from dcparallel.loss import IGNORE_INDEX

log = logging.getLogger(__name__)

FORMATS = ("text", "chat")
#: rows per worker task when lengths are computed in a process pool
CHUNK = 512
CACHE_VERSION = 1


class BadSample(ValueError):
    """A sample that cannot be trained on (the message says why)."""


@dataclass(frozen=True)
class TextSettings:
    """How rows become tokens. ``field``: the column holding the text ("text") or the
    messages ("messages"). ``max_tokens``: longer samples are cut (``truncate``) or bad."""

    format: str = "text"
    field: str = "text"
    max_tokens: int | None = None
    truncate: bool = True


def _tokenizer_key(tokenizer: Any) -> str:
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(
        backend.to_str().encode() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items())).encode()
    )
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    h.update(json.dumps([tokenizer.bos_token_id, tokenizer.eos_token_id]).encode())
    return h.hexdigest()


def _render(tokenizer: Any, messages: list, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _check_messages(messages: Any, field: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadSample(f"'{field}' must be a non-empty list of {{'role', 'content'}} messages, not {messages!r:.60}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise BadSample(f"message {j} of '{field}' is not a {{'role', 'content'}} mapping: {m!r:.60}")
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise BadSample(f"message {j} ({m['role']}) has empty content")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadSample("the conversation has no assistant message: nothing to learn")


def chat_tokens(tokenizer: Any, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """The conversation's token ids (rendered with the chat template) and, per token,
    whether it belongs to an assistant turn."""
    full = _render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else ""
        after = _render(tokenizer, messages[: i + 1], False)
        if not after.startswith(before) or not full.startswith(after):
            raise ValueError(
                f"the tokenizer's chat template renders message {i} ({m['role']}) differently once the "
                f"conversation goes on (the first {i} messages are not a prefix of the first {i + 1}), so the "
                f"assistant tokens cannot be told apart exactly; use a template that renders earlier turns "
                f"unchanged (set tokenizer.chat_template)"
            )
        spans.append((len(before), len(after)))
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"{type(tokenizer).__name__} is a slow tokenizer: the assistant mask needs character "
            f"offsets; load the fast tokenizer (AutoTokenizer.from_pretrained(path, use_fast=True))"
        )
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(s < b and e > a for a, b in spans) for s, e in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def encode(tokenizer: Any, value: dict, s: TextSettings) -> tuple[list[int], list[int] | None]:
    """One row -> (token ids, next-token labels or None for "text"), cut at ``max_tokens``;
    `BadSample` if it cannot be trained on."""
    if s.field not in value or value[s.field] is None:
        raise BadSample(
            f"no '{s.field}' field (fields: {sorted(value)}; another field is named by [data] field, "
            f"text_dataset(field=...))"
        )
    if s.format == "text":
        text = value[s.field]
        if not isinstance(text, str) or not text.strip():
            raise BadSample(f"'{s.field}' is empty or not a string: {text!r:.60}")
        ids = list(tokenizer(text)["input_ids"])
        if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
            ids.append(tokenizer.eos_token_id)
        mask = None
    else:
        _check_messages(value[s.field], s.field)
        ids, mask = chat_tokens(tokenizer, value[s.field])
    if s.max_tokens is not None and len(ids) > s.max_tokens:
        if not s.truncate:
            raise BadSample(
                f"{len(ids)} tokens > max_tokens = {s.max_tokens} (truncate = false): shorten it, "
                f"raise max_tokens or set truncate = true"
            )
        ids = ids[: s.max_tokens]
        mask = mask[: s.max_tokens] if mask is not None else None
    if len(ids) < 2:
        raise BadSample(f"{len(ids)} token(s): a sample needs at least 2 (one target)")
    if mask is None:
        return ids, None
    labels = masked_labels(ids[1:], mask[1:])
    if all(x == IGNORE_INDEX for x in labels):
        raise BadSample(f"no assistant token within the first {len(ids)} tokens (max_tokens = {s.max_tokens})")
    return ids, labels


def masked_labels(targets: list[int], is_assistant: list[bool]) -> list[int]:
    """Next-token labels aligned with the inputs: ``targets[t]`` (the token after input t)
    where that token is an assistant token, else ``IGNORE_INDEX``; the last input has none."""
    return [y if a else IGNORE_INDEX for y, a in zip(targets, is_assistant, strict=True)] + [IGNORE_INDEX]


def _lengths_of(tokenizer: Any, values: list[dict], s: TextSettings) -> list[int | str]:
    """Token counts, or the problem's message for a bad row."""
    out: list[int | str] = []
    for v in values:
        try:
            out.append(len(encode(tokenizer, v, s)[0]))
        except BadSample as exc:
            out.append(str(exc))
    return out


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Any, s: TextSettings) -> None:
    _WORKER.update(tokenizer=tokenizer, settings=s)


def _worker_lengths(values: list[dict]) -> list[int | str]:
    return _lengths_of(_WORKER["tokenizer"], values, _WORKER["settings"])


def compute_lengths(tokenizer: Any, values: list[dict], s: TextSettings, num_workers: int) -> list[int | str]:
    """`_lengths_of` over all rows, in ``num_workers`` processes (spawned) when > 1."""
    if num_workers <= 1 or len(values) <= CHUNK:
        return _lengths_of(tokenizer, values, s)
    chunks = [values[i : i + CHUNK] for i in range(0, len(values), CHUNK)]
    with concurrent.futures.ProcessPoolExecutor(
        num_workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker, initargs=(tokenizer, s)
    ) as pool:
        return [x for part in pool.map(_worker_lengths, chunks) for x in part]


class TextDataset:
    """Map-style dataset of the good rows of a text file; items as the module says."""

    def __init__(self, rows: list[Row], tokenizer: Any, settings: TextSettings):
        self.rows, self.tokenizer, self.settings = rows, tokenizer, settings

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, i: int) -> str:
        return self.rows[i].where

    def __getitem__(self, i: int) -> dict:
        import torch

        ids, labels = encode(self.tokenizer, self.rows[i].value, self.settings)
        item = {"input_ids": torch.tensor(ids, dtype=torch.long)}
        if labels is not None:
            item["labels"] = torch.tensor(labels, dtype=torch.long)
        return item


def text_dataset(
    path: str | Path,
    tokenizer: Any,
    *,
    format: str = "text",
    field: str | None = None,
    max_tokens: int | None = None,
    truncate: bool = True,
    skip_bad: bool = False,
    cache: bool = True,
    num_workers: int | None = None,
) -> tuple[TextDataset, list[int]]:
    """The dataset of ``path`` (.jsonl, .csv, .parquet or a save_to_disk directory) and every
    sample's token count (cached beside the file). ``format``: "text" (``field`` default
    "text") or "chat" (``field`` default "messages"). Bad samples raise one error naming each
    (file:line), or are dropped and logged with ``skip_bad``. ``num_workers``: processes for
    the lengths (default: up to 8 for files of more than 4096 rows)."""
    if format not in FORMATS:
        raise ValueError(f"format = {format!r}: text datasets are 'text' or 'chat'")
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens = {max_tokens}: a sample needs at least 2 tokens")
    settings = TextSettings(format, field or ("text" if format == "text" else "messages"), max_tokens, truncate)
    p = Path(path)
    rows = read_rows(p)
    if not rows:
        raise ValueError(f"{p} holds no samples")
    if not any(settings.field in r.value for r in rows):  # before tokenizing: a whole file under another field
        raise ValueError(
            f"{p}: no row has the field '{settings.field}' (the first row's fields: "
            f'{sorted(rows[0].value)}); name the field: [data] field = "..." (text_dataset(field=...))'
        )
    counts = _cached_lengths(p, rows, tokenizer, settings, cache, num_workers)
    bad = BadData(str(p), skip_bad)
    good = []
    for row, n in zip(rows, counts, strict=True):
        if isinstance(n, str):
            bad.add(row.where, n)
        else:
            good.append((row, n))
    bad.finish(len(rows))
    if not good:
        raise ValueError(f"{p}: every one of its {len(rows)} samples is bad")
    return TextDataset([r for r, _ in good], tokenizer, settings), [n for _, n in good]


def _cached_lengths(
    p: Path, rows: list[Row], tokenizer: Any, s: TextSettings, cache: bool, num_workers: int | None
) -> list[int | str]:
    key = hashlib.sha256(
        json.dumps([CACHE_VERSION, content_hash(p), _tokenizer_key(tokenizer), asdict(s)]).encode()
    ).hexdigest()[:20]
    cache_path = p.with_name(f"{p.name}.lengths-{key}.json")
    if cache and cache_path.exists():
        try:
            counts = json.loads(cache_path.read_text())["lengths"]
            if len(counts) == len(rows):
                return counts
        except (OSError, ValueError, KeyError):
            pass  # a torn or foreign file: recompute
    workers = num_workers if num_workers is not None else (min(8, os.cpu_count() or 1) if len(rows) > 4096 else 1)
    counts = compute_lengths(tokenizer, [r.value for r in rows], s, workers)
    if cache:
        tmp = cache_path.with_name(f"{cache_path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"key": key, "settings": asdict(s), "lengths": counts}))
            tmp.replace(cache_path)
        except OSError as exc:
            log.warning("cannot cache the lengths of %s beside it (%s); they are recomputed next time", p, exc)
    return counts
