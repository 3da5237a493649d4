"""`DataCentricTrainer` at world 1, in process: what it refuses (each naming the argument and
the fix), and its steps against dcparallel's own loop on the same planned steps (the
two-rank run with evaluation, checkpoints and resume: tests/e2e/test_hf_trainer_torchrun.py)."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import TrainingArguments  # noqa: E402

from dcparallel.integrations import DataCentricArguments, DataCentricTrainer  # noqa: E402
from tests import train_fixtures as tf  # noqa: E402


def _model():
    return tf.tiny_llama(64)


def _rows(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 64, (int(torch.randint(6, 40, (1,), generator=g)),), generator=g).tolist()
        cut = len(ids) // 3  # completion-only: no loss on the first third
        rows.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:]})
    return rows


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        learning_rate=0.01,
        max_steps=3,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        max_grad_norm=0.5,
        weight_decay=0.01,
        warmup_steps=1,
    )
    return TrainingArguments(**{**base, **kw})


@pytest.mark.parametrize(
    "change, words",
    [
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps=2"),
        ({"optim": "sgd"}, "optim='sgd'"),
        ({"fp16": True}, "fp16=True needs a loss scaler.*pass bf16=True"),
        ({"bf16": True, "bf16_full_eval": True}, "bf16_full_eval=True casts the model.*pass bf16_full_eval=False"),
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1: .* give dc_args.loss_fn"),
        ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha=5.0: .* set it to None"),
    ],
)
def test_refuses_what_it_would_not_do_exactly(tmp_path, change, words):
    with pytest.raises(ValueError, match=words):
        DataCentricTrainer(
            model=_model(),
            args=_args(tmp_path, **change),
            train_dataset=_rows(),
            dc_args=DataCentricArguments(tokens_per_step=100, cost="analytic"),
        )


def test_refuses_a_compute_loss_func(tmp_path):
    with pytest.raises(ValueError, match="compute_loss_func: .* give dc_args.loss_fn"):
        DataCentricTrainer(
            model=_model(),
            args=_args(tmp_path),
            train_dataset=_rows(),
            compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss,
            dc_args=DataCentricArguments(tokens_per_step=100, cost="analytic"),
        )


def test_refuses_epochs_of_different_step_counts(tmp_path):
    trainer = DataCentricTrainer(
        model=_model(),
        args=_args(tmp_path, max_steps=-1, num_train_epochs=3),
        train_dataset=_rows(16),
        dc_args=DataCentricArguments(tokens_per_step=60, cost="analytic"),
    )
    with pytest.raises(ValueError, match=r"epochs' planned steps differ in number \(\[5, 6, 5\]\)"):
        trainer.get_train_dataloader()


def test_steps_equal_dcparallel_loop(tmp_path):

    rows = _rows()
    model = _model()
    trainer = DataCentricTrainer(
        model=model,
        args=_args(tmp_path),
        train_dataset=rows,
        dc_args=DataCentricArguments(tokens_per_step=100, cost="analytic"),
    )
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]

    ref = _model()
    data = [{"input_ids": torch.tensor(r["input_ids"]), "labels": torch.tensor(r["labels"][1:] + [-100])} for r in rows]
    want = tf.trainer_reference_steps(ref, data, seed=42, tokens_per_step=100)  # seed: TrainingArguments'
    assert losses == pytest.approx(want, rel=1e-6)  # fp64 step means, logged as fp32
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not torch.equal(model.lm_head.weight, _model().lm_head.weight)  # it trained


def test_bf16_autocasts_the_forward_and_keeps_fp32_states(tmp_path):
    """bf16=True on an fp32 model: each forward under autocast to bfloat16, as the Trainer's.
    Its steps equal dcparallel's loop with the same autocast, track the fp32 run's losses
    within bf16 rounding, and parameters, gradients and AdamW moments stay fp32."""
    rows = _rows()
    data = [{"input_ids": torch.tensor(r["input_ids"]), "labels": torch.tensor(r["labels"][1:] + [-100])} for r in rows]
    from transformers import DataCollatorForSeq2Seq, Trainer

    model = _model()
    collator = DataCollatorForSeq2Seq(tf.tokenizer())
    trainer = DataCentricTrainer(
        model=model,
        args=_args(tmp_path, bf16=True),
        train_dataset=rows,
        eval_dataset=rows[:5],
        data_collator=collator,
        dc_args=DataCentricArguments(tokens_per_step=100, cost="analytic"),
    )
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]

    ref = _model()
    assert losses == pytest.approx(
        tf.trainer_reference_steps(ref, data, seed=42, tokens_per_step=100, autocast=True), rel=1e-6
    )
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
    # evaluation under the same autocast as the plain Trainer's with bf16=True
    plain = Trainer(model=ref, args=_args(tmp_path / "plain", bf16=True), eval_dataset=rows[:5], data_collator=collator)
    ref32 = _model()
    ref32.load_state_dict(ref.state_dict())  # a model of its own: the Trainer patches the forward it prepares
    plain32 = Trainer(model=ref32, args=_args(tmp_path / "plain32"), eval_dataset=rows[:5], data_collator=collator)
    got = trainer.evaluate()["eval_loss"]
    assert got == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-6)
    assert got != pytest.approx(plain32.evaluate()["eval_loss"], rel=1e-6)  # the autocast ran
    fp32 = tf.trainer_reference_steps(_model(), data, seed=42, tokens_per_step=100)
    assert losses == pytest.approx(fp32, rel=2e-2) and losses != pytest.approx(fp32, rel=1e-6)  # bf16 ran
    opt = trainer.optimizer
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {t.dtype for t in (opt.master, opt.exp_avg, opt.exp_avg_sq, opt.flat.flat_grad)} == {torch.float32}


def test_bf16_model_keeps_fp32_masters(tmp_path):
    """A model loaded in bfloat16 with bf16=True: the AdamW masters and moments are fp32 and
    the losses track the fp32 run's within bf16 rounding."""
    rows = _rows()
    data = [{"input_ids": torch.tensor(r["input_ids"]), "labels": torch.tensor(r["labels"][1:] + [-100])} for r in rows]
    model = _model().to(torch.bfloat16)
    trainer = DataCentricTrainer(
        model=model,
        args=_args(tmp_path, bf16=True),
        train_dataset=rows,
        dc_args=DataCentricArguments(tokens_per_step=100, cost="analytic"),
    )
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    fp32 = tf.trainer_reference_steps(_model(), data, seed=42, tokens_per_step=100)
    assert losses == pytest.approx(fp32, rel=3e-2)
    opt = trainer.optimizer
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {t.dtype for t in (opt.master, opt.exp_avg, opt.exp_avg_sq, opt.flat.flat_grad)} == {torch.float32}


def _lora(seed=0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def _lora_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_lora_model_resumes_to_the_same_weights(tmp_path):
    """A PEFT LoRA model: a run of 3 steps saving every step, and a second trainer resumed from
    the step-1 checkpoint (the adapter loaded by the Trainer into the engine's parameters),
    end at the same adapter weights; the frozen base is unchanged. The resumed run saves steps
    2 and 3 again into the same folders: each ``dc_state`` is written afresh, so
    torch.distributed.checkpoint finds no checkpoint to overwrite (and warns of none)."""
    import warnings

    pytest.importorskip("peft")
    rows = _rows()
    runs = []
    for resume in (None, str(tmp_path / "checkpoint-1")):
        model = _lora()
        base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        trainer = DataCentricTrainer(
            model=model,
            args=_args(tmp_path, save_strategy="steps", save_steps=1),
            train_dataset=rows,
            dc_args=DataCentricArguments(tokens_per_step=100, cost="analytic"),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train(resume_from_checkpoint=resume)
        assert not [w for w in caught if "existing checkpoint" in str(w.message)], [str(w.message) for w in caught]
        runs.append(_lora_weights(model))
        assert (tmp_path / "checkpoint-1" / "dc_state" / ".metadata").is_file()  # the one format
        assert not list(tmp_path.glob("checkpoint-*/dc_optimizer_rank*.pt"))
        assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if not p.requires_grad)
    first, resumed = runs
    assert first.keys() == resumed.keys() and any("lora_B" in n for n in first)
    for name, w in first.items():
        torch.testing.assert_close(resumed[name], w, rtol=1e-6, atol=0, msg=name)
    assert any(not torch.equal(w, v) for w, v in zip(first.values(), _lora_weights(_lora()).values()))


def test_a_checkpoint_without_dc_state_is_refused_with_why(tmp_path):
    """A folder without the one format's ``dc_state``: one of dcparallel 0.1's per-rank
    optimizer files is named as such, any other as not a DataCentricTrainer's."""
    from dcparallel.integrations.hf_trainer import _state_folder

    with pytest.raises(ValueError, match=r"has no dc_state/: resume a DataCentricTrainer from its own"):
        _state_folder(tmp_path)
    torch.save({"world_size": 1}, tmp_path / "dc_optimizer_rank0.pt")
    with pytest.raises(ValueError, match=r"dcparallel 0.1's per-rank optimizer files .*from_pretrained"):
        _state_folder(tmp_path)


def test_readme_lines_train_as_written(tmp_path, monkeypatch):
    """The README's two changed lines, run as written on a Trainer script's names: one step
    whose loss is dcparallel's loop's."""
    from transformers import DataCollatorForSeq2Seq

    tf.analytic_arguments(monkeypatch)
    rows = _rows()
    names = {
        "model": _model(),
        "training_args": _args(tmp_path, max_steps=1),
        "train": rows,
        "test": rows[:4],
        "collator": DataCollatorForSeq2Seq(tf.tokenizer()),
    }
    exec(tf.readme_block("trainer = DataCentricTrainer("), names)
    assert names["trainer"].dc_args.tokens_per_step == 65536
    names["trainer"].train()
    losses = [row["loss"] for row in names["trainer"].state.log_history if "loss" in row]
    data = [{"input_ids": torch.tensor(r["input_ids"]), "labels": torch.tensor(r["labels"][1:] + [-100])} for r in rows]
    assert losses == pytest.approx(
        tf.trainer_reference_steps(_model(), data, seed=42, tokens_per_step=65536, steps=1), rel=1e-6
    )


def _spied(trainer):
    """The trainer's loader, its `observe` recording (step index, plan, seconds, fed?)."""
    loader = trainer.get_train_dataloader().dc.loader
    calls, observe = [], loader.observe

    def spy(step, seconds):
        fed = observe(step, seconds)
        calls.append((step.index, step.plan, list(seconds), fed))
        return fed

    loader.observe = spy
    return loader, calls


def test_refine_steps_feed_the_measured_times_and_resume_with_them(tmp_path):
    """refine_steps=2: steps 0 and 1 feed one measured time per micro-batch to the loader,
    step 2 nothing; the checkpoint after step 2 holds the fed rows, and a resume from it
    plans with the same fit without measuring again."""
    from dcparallel.cost.refined import RefinedCost

    dc_args = DataCentricArguments(tokens_per_step=100, cost="analytic", refine_steps=2)
    args = _args(tmp_path, save_strategy="steps", save_steps=2)
    trainer = DataCentricTrainer(model=_model(), args=args, train_dataset=_rows(), dc_args=dc_args)
    loader, calls = _spied(trainer)
    trainer.train()
    assert [(i, fed) for i, _, _, fed in calls] == [(0, True), (1, True), (2, False)]
    times = [s for _, plan, seconds, _ in calls[:2] for s in seconds]
    assert len(calls[0][2]) == len(calls[0][1].work_of(0)) and all(s > 0 for s in times)
    assert [row[-1] for row in loader.state_dict()["refine"]["rows"]] == times  # world 1: every row is rank 0's
    cost = loader.context.cost
    assert isinstance(cost, RefinedCost) and cost.fitted and loader.refine_left == 0

    resumed = DataCentricTrainer(model=_model(), args=args, train_dataset=_rows(), dc_args=dc_args)
    again, again_calls = _spied(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert [(i, fed) for i, _, _, fed in again_calls] == [(2, False)]
    assert again.state_dict()["refine"] == {
        "left": 0,
        "rows": [list(map(_plain, r)) for r in loader.state_dict()["refine"]["rows"]],
    }
    assert again_calls[0][1] == calls[2][1]  # step 2 planned alike
    assert {k: again.context.cost.correction(k) for k in cost.fitted} == {k: cost.correction(k) for k in cost.fitted}


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def test_refine_steps_0_feeds_nothing_and_plans_as_the_loader(tmp_path):
    from dcparallel import DataCentricParallel
    from dcparallel.cost.refined import RefinedCost

    rows = _rows()
    trainer = DataCentricTrainer(
        model=_model(),
        args=_args(tmp_path),
        train_dataset=rows,
        dc_args=DataCentricArguments(tokens_per_step=100, cost="analytic"),
    )
    loader, calls = _spied(trainer)
    trainer.train()
    assert [(i, fed) for i, _, _, fed in calls] == [(0, False), (1, False), (2, False)]
    assert not isinstance(loader.context.cost, RefinedCost) and loader.state_dict()["refine"]["rows"] == []
    data = [{"input_ids": torch.tensor(r["input_ids"])} for r in rows]
    plain = DataCentricParallel(_model(), seed=42).prepare(
        data, lengths=[len(r["input_ids"]) for r in rows], tokens_per_step=100, cost="analytic"
    )
    assert [plan for _, plan, _, _ in calls] == [step.plan for step in list(plain)[:3]]


def test_bf16_counts_the_autocast_weight_copies(tmp_path):
    """bf16=True: autocast's bf16 copies of the fp32 weights (every linear layer's, 2 bytes a
    parameter) are model states, and the profiler's meter measures the activations under the
    same autocast without them. On the first micro-batch the planner plans (short chat rows,
    a Llama whose weights outweigh the activations of ~100 tokens), the bytes beyond the
    parameters that torch's MemTracker sees held at the end of the forward (where the copies
    and the saved activations peak together) are what the profiled path counts (meter +
    copies), and more than a forward without autocast holds, which is what was profiled and
    counted before. (Peaks through the backward at more shapes:
    benchmarks/autocast-memory_cpu_2026-12-07.md.)"""
    import dataclasses

    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    from dcparallel.cost.base import state_recipe
    from dcparallel.profile import shards

    model = tf.tiny_llama(4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4)
    trainer = DataCentricTrainer(
        model=model,
        args=_args(tmp_path, bf16=True),
        train_dataset=_rows(),
        dc_args=DataCentricArguments(tokens_per_step=100, cost="analytic"),
    )
    dc = trainer.dc
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert dc.spec.autocast_params == linear  # no biases; the embedding table is not cast
    trainer.get_train_dataloader()
    old = state_recipe(dataclasses.replace(dc.spec, autocast_params=0), 1)
    assert dc.cost.model_state_bytes() == old.states + 2 * linear
    batch = next(iter(next(iter(dc.loader))))
    assert batch.seq_len <= 128  # short: the copies outweigh what bf16 saves on activations

    def forward(autocast: bool, around, at_end=lambda: None) -> None:
        with dc.micro_batch(batch) as ctx, around:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = dc.loss_fn(model, batch, ctx)
            at_end()  # the graph of ``loss`` alive
        del loss
        dc.zero_grad()

    def meter(autocast: bool) -> int:  # the profiler's measurement of one micro-batch
        m = shards.meter(dc.engine, 0.0, None)
        forward(autocast, m)
        return m.bytes

    tracker, snaps = MemTracker(), []
    forward(True, tracker, lambda: snaps.append(tracker.get_tracker_snapshot("current")[torch.device("cpu")]))
    held = snaps[0]["Total"] - snaps[0][_MemRefType.PARAM]
    counted, before = meter(True) + 2 * linear, meter(False)
    # slack: the loss and its target count, scalars nothing saves for backward (1 KiB; a layer's
    # copies are a MiB)
    assert before < held <= counted + 1024, (before, held, counted)
