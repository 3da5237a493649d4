"""Real datasets: text / chat files (JSONL, Parquet, save_to_disk) with the assistant-only
loss, the lengths cache, latents manifests, and every bad-data class named with its place."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from dcparallel.data import latents_dataset, text_dataset
from dcparallel.data import text_data as td
from dcparallel.data.collate import IGNORE_INDEX, collate_text
from dcparallel.plan.types import MicroBatch
from dcparallel.spec import Layout
from tests import train_fixtures as tf

pytest.importorskip("transformers")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    return tf.tokenizer()


def test_assistant_mask_equals_transformers_generation_mask(tok):
    """The mask found by rendering turn by turn equals transformers' return_assistant_tokens_mask
    of the same template written with {% generation %} markers, on every conversation."""
    gen = tf.tokenizer(tf.GENERATION_TEMPLATE)
    for conv in tf.conversations(30, seed=1):
        ids, mask = td.chat_tokens(tok, conv["messages"])
        ref = gen.apply_chat_template(
            conv["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert ids == list(ref["input_ids"]) and mask == [bool(x) for x in ref["assistant_masks"]]
        assert any(mask) and not all(mask)


def test_chat_items_carry_labels_on_assistant_tokens_only(tmp_path, tok):
    convs = tf.conversations(12, seed=2)
    path = tf.write_jsonl(tmp_path / "chat.jsonl", convs)
    ds, lengths = text_dataset(path, tok, format="chat")
    assert len(ds) == 12 and lengths == [len(ds[i]["input_ids"]) for i in range(12)]
    for i in range(12):
        ids, mask = td.chat_tokens(tok, convs[i]["messages"])
        item = ds[i]
        assert item["input_ids"].tolist() == ids
        want = [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
        assert item["labels"].tolist() == want
    # the text collate keeps per-token labels: the packed row's targets are exactly the assistant tokens
    batch = collate_text({i: ds[i] for i in (0, 1)}, MicroBatch((0, 1), Layout(1, 2)), (0,), 0)
    assert batch.labels[0, : batch.seq_len].tolist() == ds[0]["labels"].tolist() + ds[1]["labels"].tolist()
    assert int(batch.loss_mask.sum()) == sum(int((ds[i]["labels"] != IGNORE_INDEX).sum()) for i in (0, 1))


def test_prompt_tokens_carry_no_loss(tmp_path, tok):
    """Changing the next-token target of a prompt position cannot change the engine's gradient;
    changing an assistant position's target does."""
    from transformers import AutoModelForCausalLM

    from dcparallel.runtime.engine import Engine

    conv = tf.conversations(1, seed=3)[0]["messages"]
    ids, mask = td.chat_tokens(tok, conv)
    model_dir = tf.llama_dir(tmp_path / "m", len(tok))

    def grads(targets: list[int]) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
        dc = Engine(model)
        item = {"input_ids": torch.tensor(ids), "labels": torch.tensor(td.masked_labels(targets, mask[1:]))}
        batch = collate_text({0: item}, MicroBatch((0,), Layout(1, 1)), (0,), 0)
        with dc.micro_batch(batch, last=True) as ctx:
            ctx.backward(dc.adapter.loss_fn(model, batch, ctx))
        dc.sync_gradients()
        return dc.flat_grad[: dc.numel].clone()

    targets = ids[1:]
    prompt = next(t for t in range(len(targets)) if not mask[t + 1])
    answer = next(t for t in range(len(targets)) if mask[t + 1])
    base = grads(targets)
    other = lambda t: [*targets[:t], (targets[t] + 1) % len(tok), *targets[t + 1 :]]
    assert torch.equal(grads(other(prompt)), base)
    assert not torch.allclose(grads(other(answer)), base)


def test_text_jsonl_parquet_and_save_to_disk_agree_and_lengths_are_cached(tmp_path, tok, monkeypatch):
    rows = [{"text": " ".join(tf.WORDS[i : i + 3 + i % 7])} for i in range(20)]
    jsonl = tf.write_jsonl(tmp_path / "t.jsonl", rows)
    ds, lengths = text_dataset(jsonl, tok, format="text")
    assert ds[0]["input_ids"].tolist() == tok(rows[0]["text"])["input_ids"] + [tok.eos_token_id]
    assert "labels" not in ds[0]  # the collate shifts: the whole sequence is the target
    caches = list(tmp_path.glob("t.jsonl.lengths-*.json"))
    assert len(caches) == 1 and json.loads(caches[0].read_text())["lengths"] == lengths

    def no_recompute(*a, **k):
        raise AssertionError("lengths recomputed despite the cache")

    monkeypatch.setattr(td, "compute_lengths", no_recompute)
    assert text_dataset(jsonl, tok, format="text")[1] == lengths
    with pytest.raises(AssertionError, match="recomputed"):  # another setting is another key
        text_dataset(jsonl, tok, format="text", max_tokens=4)
    monkeypatch.undo()

    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    ds2, lengths2 = text_dataset(tmp_path / "t.parquet", tok)
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    ds3, lengths3 = text_dataset(tmp_path / "hf", tok)
    assert lengths == lengths2 == lengths3
    assert all(torch.equal(ds[i]["input_ids"], ds3[i]["input_ids"]) for i in range(20))


@pytest.mark.slow  # each spawned worker imports transformers (~10 s of CPU)
def test_lengths_in_a_process_pool_equal_serial(tmp_path, tok, monkeypatch):
    convs = tf.conversations(10, seed=4)
    monkeypatch.setattr(td, "CHUNK", 3)
    values = convs
    s = td.TextSettings("chat", "messages")
    assert td.compute_lengths(tok, values, s, num_workers=2) == td.compute_lengths(tok, values, s, num_workers=1)


def test_max_tokens_cuts_or_refuses(tmp_path, tok):
    path = tf.write_jsonl(tmp_path / "t.jsonl", [{"text": "one two three four five six"}, {"text": "red blue"}])
    ds, lengths = text_dataset(path, tok, max_tokens=4)
    assert lengths == [4, 3] and ds[0]["input_ids"].tolist() == tok("one two three four")["input_ids"]
    with pytest.raises(ValueError, match=rf"{path}:1: 7 tokens > max_tokens = 4 \(truncate = false\)"):
        text_dataset(path, tok, max_tokens=4, truncate=False)


def test_bad_text_samples_are_named_with_file_and_line_or_skipped(tmp_path, tok, caplog):
    good = tf.conversations(2, seed=5)
    rows = [
        good[0],
        {"messages": []},
        {"text": "hi"},
        {"messages": [{"role": "user", "content": "red"}]},
        good[1],
        {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]},
    ]
    path = tf.write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(ValueError) as e:
        text_dataset(path, tok, format="chat", max_tokens=64)
    msg = str(e.value)
    assert "4 bad sample(s) of 6" in msg and "skip_bad = true" in msg
    assert f"{path}:2: 'messages' must be a non-empty list" in msg  # empty sample
    assert f"{path}:3: no 'messages' field (fields: ['text']; another field is named by [data] field" in msg
    assert f"{path}:4: the conversation has no assistant message" in msg
    assert f"{path}:6: message 0 (user) has empty content" in msg
    with caplog.at_level(logging.WARNING):
        ds, lengths = text_dataset(path, tok, format="chat", max_tokens=64, skip_bad=True)
    assert len(ds) == 2 and [ds.where(i) for i in range(2)] == [f"{path}:1", f"{path}:5"]
    assert "skipped 4 bad sample(s) of 6" in caplog.text
    # an assistant turn entirely past max_tokens leaves nothing to learn
    with pytest.raises(ValueError, match=rf"{path}:1: no assistant token within the first 3 tokens"):
        text_dataset(tf.write_jsonl(path, [good[0]]), tok, format="chat", max_tokens=3)

    text = tf.write_jsonl(tmp_path / "t.jsonl", [{"text": "red"}, {"text": ""}])
    with pytest.raises(ValueError, match=rf"{text}:2: 'text' is empty"):
        text_dataset(text, tok)
    with pytest.raises(ValueError, match=r"does not exist; give a .jsonl"):  # missing file
        text_dataset(tmp_path / "nope.jsonl", tok)
    (tmp_path / "broken.jsonl").write_text('{"text": "red"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not a JSON object"):
        text_dataset(tmp_path / "broken.jsonl", tok)


def test_latents_manifest_sizes_items_and_header_checks(tmp_path):
    pytest.importorskip("safetensors")
    shapes = [(1, 4, 4), (2, 4, 6), (1, 4, 4)]
    manifest = tf.latents_manifest(tmp_path, shapes)
    ds, sizes = latents_dataset(manifest, channels=4, text_dim=16)
    assert sizes == shapes and len(ds) == 3
    item = ds[1]
    assert item["latents"].shape == (4, 2, 4, 6) and item["encoder_hidden_states"].shape == (4, 16)
    # sizes from the file headers when the manifest has no shape columns; .pt files too
    pt = tmp_path / "pt"
    pt.mkdir()
    m2 = tf.latents_manifest(pt, shapes, fmt="pt")
    rows = [json.loads(x) for x in m2.read_text().splitlines()]
    tf.write_jsonl(m2, [{k: v for k, v in r.items() if k in ("latents", "text_embeddings")} for r in rows])
    ds2, sizes2 = latents_dataset(m2)
    assert sizes2 == shapes and torch.equal(ds2[2]["latents"], torch.load(pt / "lat2.pt"))
    # a CSV manifest
    csv = tmp_path / "m.csv"
    csv.write_text("latents,text_embeddings,frames,height,width\nlat0.safetensors,txt0.safetensors,1,4,4\n")
    assert latents_dataset(csv)[1] == [(1, 4, 4)]


def test_bad_latent_rows_are_named_with_file_and_line(tmp_path, caplog):
    pytest.importorskip("safetensors")
    manifest = tf.latents_manifest(tmp_path, [(1, 4, 4), (2, 4, 6), (1, 4, 4), (1, 4, 4)])
    rows = [json.loads(x) for x in manifest.read_text().splitlines()]
    rows[1]["frames"] = 3  # disagrees with the file
    rows[2]["latents"] = "gone.safetensors"  # missing file
    del rows[3]["text_embeddings"]  # missing column
    tf.write_jsonl(manifest, rows)
    with pytest.raises(ValueError) as e:
        latents_dataset(manifest)
    msg = str(e.value)
    assert "3 bad sample(s) of 4" in msg
    assert (
        f"{manifest}:2: the manifest says (frames, height, width) = (3, 4, 6) but {tmp_path}/lat1.safetensors "
        f"holds latents of shape (4, 2, 4, 6)"
    ) in msg
    assert f"{manifest}:3: latents file {tmp_path}/gone.safetensors does not exist" in msg
    assert f"{manifest}:4: no 'text_embeddings' column" in msg
    with caplog.at_level(logging.WARNING):
        ds, sizes = latents_dataset(manifest, skip_bad=True)
    assert sizes == [(1, 4, 4)] and "skipped 3 bad sample(s) of 4" in caplog.text
    with pytest.raises(
        ValueError,
        match=rf"{manifest}:1: latents {tmp_path}/lat0.safetensors have 4 channels; the "
        rf"model takes 16",
    ):
        latents_dataset(manifest, channels=16, skip_bad=False)
    from safetensors.torch import save_file

    save_file({"latents": torch.zeros(4, 0, 4, 4)}, tmp_path / "lat0.safetensors")  # an empty sample
    with pytest.raises(ValueError, match=r"manifest.jsonl:1: latents .*lat0.safetensors are empty"):
        latents_dataset(manifest)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    shifting = tf.tokenizer(
        "{% for m in messages %}{% if loop.last %}<|im_end|>{% endif %}{{ m['content'] }} {% endfor %}"
    )
    path = tf.write_jsonl(tmp_path / "chat.jsonl", tf.conversations(1, seed=6))
    with pytest.raises(
        ValueError,
        match=r"renders message \d \(assistant\) differently once the conversation goes "
        r"on .* use a template that renders earlier turns unchanged",
    ):
        text_dataset(path, shifting, format="chat")
