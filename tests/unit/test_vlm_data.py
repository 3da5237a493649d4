"""The chat-with-images reader of `dcparallel train` (`data.vlm_data`): lengths and grids from
the images' headers before decoding, equal to what decoding and the image processor give;
placeholders expanded by the Qwen-VL rule; the loss on assistant tokens only; bad records
named; the config's refusals for vision-language models (`apps.train_vlm`)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from dcparallel.loss import IGNORE_INDEX  # noqa: E402
from dcparallel.spec import VisionSize  # noqa: E402
from tests import vlm_train_fixtures as vf  # noqa: E402


@pytest.fixture(scope="module")
def parts():
    return vf.tokenizer(), vf.image_processor()


def _read(tmp_path, rows, parts, **kw):
    from dcparallel.data.vlm_data import vlm_dataset

    tok, ip = parts
    path = vf.write_jsonl(tmp_path / "chat.jsonl", rows)
    return vlm_dataset(path, tok, ip, image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"), **kw)


def test_lengths_from_headers_equal_the_decoded_samples(tmp_path, parts):
    tok, ip = parts
    rows = vf.chats(tmp_path, 8, seed=1)
    ds, lengths = _read(tmp_path, rows, parts)
    assert len(ds) == 8 and len(lengths) == 8
    image = tok.convert_tokens_to_ids("<|image_pad|>")
    seen_grids = set()
    for i, row in enumerate(rows):
        item = ds[i]
        assert len(item["input_ids"]) == int(lengths[i])  # the planner's length is the trained length
        paths = [
            c["image"]
            for m in row["messages"]
            if isinstance(m["content"], list)
            for c in m["content"]
            if c["type"] == "image"
        ]
        if not paths:
            assert type(lengths[i]) is int  # a text-only chat is its token count
            assert set(item) == {"input_ids", "labels"}
            assert not (item["input_ids"] == image).any()
            continue
        from PIL import Image

        decoded = ip(images=[Image.open(tmp_path / p).convert("RGB") for p in paths], return_tensors="pt")
        torch.testing.assert_close(item["pixel_values"], decoded["pixel_values"])
        assert item["image_grid_thw"].tolist() == decoded["image_grid_thw"].tolist()
        # the planner's size carries each image's tower patches, as the tower encodes them
        assert lengths[i].patches == tuple(int(n) for n in decoded["image_grid_thw"].prod(-1))
        # one placeholder per merged 2 x 2 patches of each image, in one run per image
        want = int(decoded["image_grid_thw"].prod(-1).sum()) // 4
        assert int((item["input_ids"] == image).sum()) == want
        seen_grids |= {tuple(g) for g in decoded["image_grid_thw"].tolist()}
    assert seen_grids == {(1, 8, 8), (1, 8, 12), (1, 12, 16)}  # the three sizes
    # spawned DataLoader workers get the dataset pickled: they decode the same items
    import pickle

    again = pickle.loads(pickle.dumps(ds))
    for i in range(len(ds)):
        a, b = ds[i], again[i]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_loss_counts_the_assistant_answer_only(tmp_path, parts):
    tok, _ = parts
    rows = vf.chats(tmp_path, 4, seed=2)
    ds, _ = _read(tmp_path, rows, parts)
    for i, row in enumerate(rows):
        answer = row["messages"][-1]["content"]
        answer = answer if isinstance(answer, str) else answer[0]["text"]
        item = ds[i]
        targets = [t for t in item["labels"].tolist() if t != IGNORE_INDEX]
        assert tok.decode(targets).split() == answer.split() + ["<|im_end|>"]
        at = (item["labels"] != IGNORE_INDEX).nonzero()[:, 0]
        torch.testing.assert_close(item["labels"][at], item["input_ids"][at + 1])  # next-token targets


def test_sizes_in_the_record_spare_the_header_and_a_truncated_file_fails_on_decoding(tmp_path, parts):
    """A PNG cut after its header: its size (and so the sample's length) is read without
    decoding; decoding it in the item fails."""
    tok, _ = parts
    vf.draw(tmp_path / "a.png", (32, 24), "red")
    data = (tmp_path / "a.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: data.index(b"IDAT") + 8])  # the pixels' first bytes only
    row = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "image": "cut.png"}, {"type": "text", "text": "what color is this"}],
            },
            {"role": "assistant", "content": "red"},
        ]
    }
    given = json.loads(json.dumps(row))
    given["messages"][0]["content"][0] |= {"width": 16, "height": 16}
    ds, lengths = _read(tmp_path, [row, given], parts)
    text = len(tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"])
    # 32 x 24: 12 x 16 patches (48 tokens); 16 x 16: 8 x 8 (16 tokens)
    assert lengths == [VisionSize(text - 1 + 48, (192,)), VisionSize(text - 1 + 16, (64,))]
    with pytest.raises(OSError):
        ds[0]


def test_bad_records_are_named_or_skipped(tmp_path, parts):
    vf.draw(tmp_path / "a.png", (16, 16), "red")
    (tmp_path / "junk.png").write_text("not an image")
    img = {"type": "image", "image": "a.png"}
    user = {"role": "user", "content": [img, {"type": "text", "text": "what color is this"}]}
    good = {"messages": [user, {"role": "assistant", "content": "red"}]}
    bad = [
        {
            "messages": [
                {"role": "user", "content": [{"type": "video", "video": "v.mp4"}]},
                {"role": "assistant", "content": "red"},
            ]
        },
        {"messages": [user, {"role": "assistant", "content": [img]}]},
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": "missing.png"}]},
                {"role": "assistant", "content": "red"},
            ]
        },
        {"messages": [user]},
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": "junk.png"}]},
                {"role": "assistant", "content": "red"},
            ]
        },
    ]
    with pytest.raises(ValueError) as err:
        _read(tmp_path, [good, *bad], parts)
    msg = str(err.value)
    assert "5 bad sample(s) of 6" in msg
    for line, what in (
        (2, "video entry"),
        (3, "(assistant) holds an image"),
        (4, "['missing.png'] not found"),
        (5, "no assistant message"),
        (6, "cannot read an image's header"),
    ):
        named = [x for x in msg.splitlines() if f"chat.jsonl:{line}: " in x]
        assert len(named) == 1 and what in named[0], (line, msg)
    ds, lengths = _read(tmp_path, [good, *bad], parts, skip_bad=True)
    assert len(ds) == 1 and ds.where(0).endswith("chat.jsonl:1")
    with pytest.raises(ValueError, match="a chat with images is not cut"):
        _read(tmp_path, [good], parts, max_tokens=10)


def test_a_template_without_one_placeholder_per_image_is_refused(tmp_path, parts):
    tok, ip = parts
    drop = vf.tokenizer()
    drop.chat_template = vf.CHAT_TEMPLATE.replace("<|image_pad|>", "")  # renders no placeholder
    vf.draw(tmp_path / "a.png", (16, 16), "red")
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": "a.png"}]},
            {"role": "assistant", "content": "red"},
        ]
    }
    with pytest.raises(ValueError, match="rendered 0 image placeholder token"):
        _read(tmp_path, [row], (drop, ip))


def test_the_config_takes_a_vlm_folder_and_refuses_what_it_does_not_train(tmp_path):
    from dcparallel.apps.train_config import Config
    from dcparallel.apps.train_vlm import check_vlm_config

    folder = tmp_path / "vlm"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"architectures": ["Qwen2_5_VLForConditionalGeneration"], "vision_config": {"depth": 2}})
    )
    cfg = Config.from_dict({"model": {"pretrained": str(folder), "freeze_vision": True}})
    assert cfg.model.family == "transformers" and cfg.model.is_vlm()
    for raw, what in (
        ({"lora": {"rank": 4}}, "LoRA is not tested with a vision tower"),
        ({"train": {"shard_size": 2}}, "shard_size = 2"),
        ({"data": {"path": "x.jsonl", "format": "text"}}, 'format = "text"'),
    ):
        with pytest.raises(ValueError, match=what):
            check_vlm_config(Config.from_dict({"model": {"pretrained": str(folder)}, **raw}))
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="freeze_vision = true needs a vision-language model"):
        Config.from_dict({"model": {"pretrained": str(llama), "freeze_vision": True}})


def test_check_reads_the_chat_with_images_file_before_launch(tmp_path):
    """`dcparallel train --check` on a vision-language folder (its config and processor, no
    weights needed): every sample read and counted from metadata."""
    import transformers

    from dcparallel.apps.train_config import Config
    from dcparallel.apps.train_inputs import check_config

    folder = vf.save_processor(tmp_path / "vlm")
    tok = vf.tokenizer()
    transformers.Qwen2_5_VLConfig(
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"), architectures=["Qwen2_5_VLForConditionalGeneration"]
    ).save_pretrained(folder)
    rows = vf.chats(tmp_path, 8, seed=3)
    vf.write_jsonl(tmp_path / "chat.jsonl", rows)
    _, lengths = _read(tmp_path, rows, (tok, vf.image_processor()))
    cfg = Config.from_dict({"model": {"pretrained": str(folder)}, "data": {"path": str(tmp_path / "chat.jsonl")}})
    said = check_config(cfg, "run.toml")
    assert f"8 samples of {min(lengths)}-{max(lengths)} tokens" in said and min(lengths) < 20 < 60 < max(lengths)
