"""A TRL `SFTTrainer` script moved to dcparallel by the lines marked `# dcparallel`, run five
ways in one launch (``torchrun --nproc-per-node 2 sft_trainer_worker.py MODEL OUT``) on
conversational prompt-completion rows (TRL's completion-only loss):

1. the SFTTrainer, 4 planned steps, evaluation and a checkpoint every 2, TensorBoard events;
2. dcparallel's own loop on the same steps, its labels built here from the chat template:
   the prompt rendered with the generation prompt, loss on the tokens after it only;
3. the SFTTrainer resumed from the step-2 checkpoint;
4. the unmodified SFTTrainer's evaluation of the model holding run 1's weights;
5. the SFTTrainer given a PEFT ``peft_config`` (LoRA), 2 steps, its adapter saved by
   ``trainer.save_model``.

Rank 0 writes OUT/result.pt: each run's per-step losses and final trainable weights, and the
log history. ``sft_trainer_worker.py MODEL OUT CHECKPOINT`` runs 3 alone, resumed from
another launch's CHECKPOINT (another world size: the optimizer shards reshard).
"""

import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

import dcparallel
from dcparallel.integrations import DataCentricArguments, DataCentricSFTTrainer  # dcparallel
from tests import train_fixtures as tf

torch.set_num_threads(1)
MODEL, OUT = (Path(a) for a in sys.argv[1:3])
STEPS, LR, WARMUP, DECAY, CLIP, TOKENS = 4, 0.02, 2, 0.01, 0.5, 120
OPTIMIZER = {"lr": LR, "warmup_steps": WARMUP, "weight_decay": DECAY, "max_grad_norm": CLIP}  # the reference loop's
tok = AutoTokenizer.from_pretrained(MODEL)
rows = [{"prompt": c["messages"][:-1], "completion": c["messages"][-1:]} for c in tf.conversations(40, seed=0)]
train, test = Dataset.from_list(rows[:-6]), Dataset.from_list(rows[-6:])


def trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def config(out, steps=STEPS, **kw):
    return SFTConfig(
        output_dir=str(out),
        learning_rate=LR,
        lr_scheduler_type="linear",
        warmup_steps=WARMUP,
        weight_decay=DECAY,
        max_grad_norm=CLIP,
        max_steps=steps,
        logging_steps=1,
        use_cpu=True,
        seed=0,
        bf16=False,
        **kw,
    )


def run_sft(resume=None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, local_files_only=True)
    args = config(
        OUT / "sft",
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        report_to=["tensorboard"],
        per_device_eval_batch_size=3,
        completion_only_loss=True,
    )
    trainer = DataCentricSFTTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=test,  # dcparallel
        processing_class=tok,
        dc_args=DataCentricArguments(tokens_per_step=TOKENS, cost="analytic"),
    )  # dcparallel
    trainer.train(resume_from_checkpoint=resume)
    return {
        "losses": [r["loss"] for r in trainer.state.log_history if "loss" in r],
        "weights": trainable(model),
        "log": trainer.state.log_history,
        "eval_loss": trainer.evaluate()["eval_loss"],
    }


def reference_eval(weights):
    """Evaluation by the unmodified SFTTrainer of the model holding the trained weights."""
    model = AutoModelForCausalLM.from_pretrained(MODEL, local_files_only=True)
    model.load_state_dict(weights, strict=False)
    args = config(OUT / "plain", report_to=[], per_device_eval_batch_size=3, completion_only_loss=True)
    return SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=test, processing_class=tok).evaluate()


def masked(row):
    """Next-token targets on the completion's tokens only, built from the chat template."""
    prompt = tok.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    ids = tok.apply_chat_template(row["prompt"] + row["completion"], tokenize=True, return_dict=True)["input_ids"]
    assert list(ids[: len(prompt)]) == list(prompt) and len(ids) > len(prompt)
    labels = [-100] * len(prompt) + list(ids[len(prompt) :])
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels[1:] + [-100])}


def run_loop():
    """dcparallel's own loop (README), with the SFTTrainer's optimizer, schedule and clipping."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, local_files_only=True)
    losses = tf.trainer_reference_steps(
        model, [masked(r) for r in rows[:-6]], tokens_per_step=TOKENS, steps=STEPS, **OPTIMIZER
    )
    return {"losses": losses, "weights": trainable(model)}


def run_lora():
    """The SFTTrainer given a LoRA ``peft_config``: ``trainer.save_model`` writes the adapter."""
    from peft import LoraConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, local_files_only=True)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    args = config(OUT / "lora", steps=2, report_to=[], save_strategy="no")
    trainer = DataCentricSFTTrainer(
        model=model,
        args=args,
        train_dataset=train,
        processing_class=tok,  # dcparallel
        peft_config=lora,
        dc_args=DataCentricArguments(tokens_per_step=TOKENS, cost="analytic"),
    )  # dcparallel
    trainer.train()
    trainer.save_model(str(OUT / "lora_export"))
    return {"weights": trainable(trainer.model)}


if len(sys.argv) > 3:  # a resume of another launch's checkpoint at this launch's world size
    torch.save(
        {"resumed": run_sft(resume=sys.argv[3]), "world": dcparallel.runtime.comm.world_size()}, OUT / "result.pt"
    )
    sys.exit()
trained = run_sft()
loop = run_loop()
resumed = run_sft(resume=str(OUT / "sft" / "checkpoint-2"))
plain_eval = reference_eval(trained["weights"])["eval_loss"]
lora = run_lora()
if dcparallel.runtime.comm.world_rank() == 0:
    torch.save(
        {
            "sft": trained,
            "loop": loop,
            "resumed": resumed,
            "plain_eval": plain_eval,
            "lora": lora,
            "world": dcparallel.runtime.comm.world_size(),
        },
        OUT / "result.pt",
    )
