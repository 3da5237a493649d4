"""A transformers `Trainer` script moved to dcparallel by the lines marked `# dcparallel`,
run three ways in one launch (``torchrun --nproc-per-node 2 hf_trainer_worker.py MODEL CHAT OUT``):

1. the Trainer, 4 planned steps, evaluation and a checkpoint every 2, TensorBoard events;
2. dcparallel's own loop on the same model, steps, optimizer, schedule and clipping;
3. the Trainer resumed from the step-2 checkpoint;
4. TRL's SFTTrainer (`DataCentricSFTTrainer`) on the raw chats, the same 4 steps;
5. the plain Trainer's evaluation of the unmodified model holding run 1's weights;
6. the Trainer on a PEFT LoRA model, 2 steps, its adapter saved by `trainer.save_model`.

Rank 0 writes OUT/result.pt: each run's per-step losses and final trainable weights, and
the Trainer's log history.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import dcparallel
from dcparallel.integrations import DataCentricArguments, DataCentricTrainer  # dcparallel
from tests import train_fixtures as tf

torch.set_num_threads(1)
MODEL, CHAT, OUT = (Path(a) for a in sys.argv[1:4])
STEPS, LR, WARMUP, DECAY, CLIP, TOKENS = 4, 0.02, 2, 0.01, 0.5, 120
OPTIMIZER = {"lr": LR, "warmup_steps": WARMUP, "weight_decay": DECAY, "max_grad_norm": CLIP}  # the reference loop's
tok = AutoTokenizer.from_pretrained(MODEL)
tok.chat_template = tf.GENERATION_TEMPLATE


def tokenized(row):  # completion-only loss: labels only on the assistant's tokens
    enc = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids = list(enc["input_ids"])
    return {"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, enc["assistant_masks"])]}


chats = [json.loads(line) for line in CHAT.read_text().splitlines()]
rows = [tokenized(r) for r in chats]
train, test = rows[:-6], rows[-6:]


def trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


class Losses(TrainerCallback):  # the logged loss of every step (logging_steps=1)
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kw):
        if "loss" in logs:
            self.losses.append(logs["loss"])


def run_trainer(out, resume=None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, local_files_only=True)
    args = TrainingArguments(
        output_dir=str(out),
        learning_rate=LR,
        lr_scheduler_type="linear",
        warmup_steps=WARMUP,
        weight_decay=DECAY,
        max_grad_norm=CLIP,
        max_steps=STEPS,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        report_to=["tensorboard"],
        per_device_eval_batch_size=3,
        use_cpu=True,
        seed=0,
        save_only_model=False,
    )
    losses = Losses()
    trainer = DataCentricTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=test,  # dcparallel
        data_collator=DataCollatorForSeq2Seq(tok),
        callbacks=[losses],
        dc_args=DataCentricArguments(tokens_per_step=TOKENS, cost="analytic"),
    )  # dcparallel
    trainer.train(resume_from_checkpoint=resume)
    return {
        "losses": losses.losses,
        "weights": trainable(model),
        "log": trainer.state.log_history,
        "eval_loss": trainer.evaluate()["eval_loss"],
    }


def run_sft():
    """The same run as TRL's SFTTrainer script: TRL formats the chats (assistant-only loss)."""
    from datasets import Dataset
    from trl import SFTConfig

    from dcparallel.integrations import DataCentricSFTTrainer  # dcparallel

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, local_files_only=True)
    args = SFTConfig(
        output_dir=str(OUT / "sft"),
        learning_rate=LR,
        lr_scheduler_type="linear",
        warmup_steps=WARMUP,
        weight_decay=DECAY,
        max_grad_norm=CLIP,
        max_steps=STEPS,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        bf16=False,
        assistant_only_loss=True,
        packing=True,
        save_strategy="no",
    )
    trainer = DataCentricSFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(chats[:-6]),  # dcparallel
        processing_class=tok,
        dc_args=DataCentricArguments(tokens_per_step=TOKENS, cost="analytic"),
    )  # dcparallel
    trainer.train()
    return {"losses": [r["loss"] for r in trainer.state.log_history if "loss" in r], "weights": trainable(model)}


def reference_eval(weights):
    """Evaluation of the unmodified model holding the trained weights, by the plain Trainer."""
    model = AutoModelForCausalLM.from_pretrained(MODEL, local_files_only=True)
    model.load_state_dict(weights, strict=False)
    args = TrainingArguments(output_dir=str(OUT / "plain"), per_device_eval_batch_size=3, use_cpu=True, report_to=[])
    return Trainer(model=model, args=args, eval_dataset=test, data_collator=DataCollatorForSeq2Seq(tok)).evaluate()


def run_loop():
    """dcparallel's own loop (README), with the Trainer's optimizer, schedule and clipping."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, local_files_only=True)
    data = [
        {"input_ids": torch.tensor(r["input_ids"]), "labels": torch.tensor(r["labels"][1:] + [-100])} for r in train
    ]  # next-token targets
    losses = tf.trainer_reference_steps(model, data, tokens_per_step=TOKENS, steps=STEPS, **OPTIMIZER)
    return {"losses": losses, "weights": trainable(model)}


def run_lora():
    """The Trainer on a PEFT LoRA model: ``trainer.save_model`` writes the adapter folder."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(MODEL, local_files_only=True),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    args = TrainingArguments(
        output_dir=str(OUT / "lora"),
        learning_rate=LR,
        max_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        save_strategy="no",
    )
    trainer = DataCentricTrainer(
        model=model,
        args=args,
        train_dataset=train,  # dcparallel
        data_collator=DataCollatorForSeq2Seq(tok),
        dc_args=DataCentricArguments(tokens_per_step=TOKENS, cost="analytic"),
    )  # dcparallel
    trainer.train()
    trainer.save_model(str(OUT / "lora_export"))
    return {"weights": trainable(model)}


trained = run_trainer(OUT / "trainer")
loop = run_loop()
resumed = run_trainer(OUT / "trainer", resume=str(OUT / "trainer" / "checkpoint-2"))
sft = run_sft()
plain_eval = reference_eval(trained["weights"])["eval_loss"]
lora = run_lora()
if dcparallel.runtime.comm.world_rank() == 0:
    torch.save(
        {
            "trainer": trained,
            "loop": loop,
            "resumed": resumed,
            "sft": sft,
            "plain_eval": plain_eval,
            "lora": lora,
            "world": dcparallel.runtime.comm.world_size(),
        },
        OUT / "result.pt",
    )
