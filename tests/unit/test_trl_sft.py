"""`DataCentricSFTTrainer` at world 1: TRL formats a chat dataset (chat template,
assistant-only loss; its packing handed to the planner) and the steps equal dcparallel's own
loop on labels built independently from the template's assistant mask."""

import pytest
import torch

pytest.importorskip("trl")
from trl import SFTConfig  # noqa: E402

from dcparallel.integrations import DataCentricArguments, DataCentricSFTTrainer  # noqa: E402
from tests import train_fixtures as tf  # noqa: E402


def _model(vocab):
    return tf.tiny_llama(vocab)


def _targets(tok, messages):
    """Next-token targets on the assistant's tokens only, from the template's mask."""
    enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids = torch.tensor(enc["input_ids"])
    labels = torch.where(torch.tensor(enc["assistant_masks"]) == 1, ids, -100)
    return {"input_ids": ids, "labels": torch.cat([labels[1:], torch.tensor([-100])])}


def test_sft_steps_equal_dcparallel_loop(tmp_path):
    from datasets import Dataset

    tok = tf.tokenizer(tf.GENERATION_TEMPLATE)
    chats = tf.conversations(16, seed=1)
    model = _model(len(tok))
    args = SFTConfig(
        output_dir=str(tmp_path),
        assistant_only_loss=True,
        packing=True,
        max_steps=3,
        learning_rate=0.01,
        warmup_steps=1,
        weight_decay=0.01,
        max_grad_norm=0.5,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        bf16=False,
    )  # fp32 parity; SFTConfig's default bf16=True: see below
    trainer = DataCentricSFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(chats),
        processing_class=tok,
        dc_args=DataCentricArguments(tokens_per_step=120, cost="analytic"),
    )
    assert args.packing and args.gradient_checkpointing  # the caller's config is left as given (TRL's defaults)
    trainer.train()
    assert not model.is_gradient_checkpointing  # recompute is the planner's, per micro-batch
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]

    ref = _model(len(tok))
    data = [_targets(tok, c["messages"]) for c in chats]
    want = tf.trainer_reference_steps(ref, data, seed=0, tokens_per_step=120)
    assert len(losses) == 3 and losses == pytest.approx(want, rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name


def _full_targets(tok, chats):
    """Next-token targets on every token of each rendered chat."""
    data = []
    for c in chats:
        ids = torch.tensor(tok.apply_chat_template(c["messages"], tokenize=True, return_dict=True)["input_ids"])
        data.append({"input_ids": ids, "labels": torch.cat([ids[1:], torch.tensor([-100])])})
    return data


def test_default_bf16_autocasts_the_forward(tmp_path):
    """SFTConfig's default bf16=True: the step's forward runs under autocast to bfloat16, its
    loss that of dcparallel's loop under the same autocast (full-sequence targets)."""
    from datasets import Dataset

    tok = tf.tokenizer(tf.GENERATION_TEMPLATE)
    chats = tf.conversations(8, seed=2)
    args = SFTConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        learning_rate=0.01,
        warmup_steps=1,
        weight_decay=0.01,
        max_grad_norm=0.5,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
    )
    assert args.bf16  # TRL's default
    trainer = DataCentricSFTTrainer(
        model=_model(len(tok)),
        args=args,
        train_dataset=Dataset.from_list(chats),
        processing_class=tok,
        dc_args=DataCentricArguments(tokens_per_step=120, cost="analytic"),
    )
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    data = _full_targets(tok, chats)
    want = tf.trainer_reference_steps(_model(len(tok)), data, seed=0, tokens_per_step=120, steps=1, autocast=True)
    fp32 = tf.trainer_reference_steps(_model(len(tok)), data, seed=0, tokens_per_step=120, steps=1)
    assert losses == pytest.approx(want, rel=1e-6) and losses != pytest.approx(fp32, rel=1e-6)


@pytest.mark.parametrize("loss_type", ["dft"])
def test_other_loss_types_are_refused(tmp_path, loss_type):
    from datasets import Dataset

    tok = tf.tokenizer(tf.GENERATION_TEMPLATE)
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, bf16=False, loss_type=loss_type)
    with pytest.raises(ValueError, match=f"loss_type='{loss_type}'.*set loss_type='nll'"):
        DataCentricSFTTrainer(
            model=_model(len(tok)),
            args=args,
            train_dataset=Dataset.from_list(tf.conversations(4)),
            processing_class=tok,
            dc_args=DataCentricArguments(tokens_per_step=120),
        )


def test_readme_lines_train_as_written(tmp_path, monkeypatch):
    """The README's two changed lines of a TRL script, run as written on its names (an
    SFTConfig, chats, a tokenizer with a chat template): one step whose loss is dcparallel's
    loop's on the rendered chats."""
    from datasets import Dataset

    tf.analytic_arguments(monkeypatch)
    tok = tf.tokenizer()
    chats = tf.conversations(8, seed=3)
    config = SFTConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        bf16=False,
    )
    names = {"model": _model(len(tok)), "sft_config": config, "dataset": Dataset.from_list(chats), "tokenizer": tok}
    exec(tf.readme_block("trainer = DataCentricSFTTrainer("), names)
    assert names["trainer"].dc_args.tokens_per_step == 65536
    names["trainer"].train()
    losses = [row["loss"] for row in names["trainer"].state.log_history if "loss" in row]
    want = tf.trainer_reference_steps(
        _model(len(tok)), _full_targets(tok, chats), seed=0, tokens_per_step=65536, steps=1
    )
    assert losses == pytest.approx(want, rel=1e-6)
