"""`DataCentricSFTTrainer`: TRL's `SFTTrainer` (its dataset formatting: chat templates,
assistant-only and completion-only loss) with `DataCentricTrainer`'s planned steps.

TRL prepares the train dataset into ``input_ids`` and ``labels`` (-100 where no loss), which
`DataCentricTrainer` turns into dcparallel's next-token targets. ``packing=True`` is TRL
packing rows into fixed-length sequences; here the planner packs the unpacked samples itself
(each step's micro-batches, documents kept apart by the attention), so TRL's packing is
turned off before TRL prepares the dataset. The step's loss is dcparallel's next-token
cross-entropy (or ``dc_args.loss_fn``): a TRL ``loss_type`` other than "nll" is refused.
"""

from __future__ import annotations

import copy
from typing import Any

from trl import SFTTrainer

from dcparallel.integrations.hf_trainer import DataCentricTrainer


class DataCentricSFTTrainer(DataCentricTrainer, SFTTrainer):
    """`trl.SFTTrainer` whose every optimizer step is a planned step (`DataCentricTrainer`);
    ``dc_args``: `DataCentricArguments`; the other arguments are SFTTrainer's."""

    def __init__(self, *args: Any, **kwargs: Any):
        config = kwargs.get("args")
        loss_type = getattr(config, "loss_type", "nll")
        if loss_type != "nll":
            raise ValueError(
                f"loss_type={loss_type!r}: DataCentricSFTTrainer's steps compute the next-token "
                f"cross-entropy ('nll'); set loss_type='nll', or give dc_args.loss_fn a loss of "
                f"(model, batch, ctx) computing yours"
            )
        if config is not None and getattr(config, "packing", False):
            config = copy.copy(config)
            config.packing = False  # the planner packs: TRL's fixed-length packing would hide the lengths
            config.padding_free = False
            kwargs["args"] = config
        super().__init__(*args, **kwargs)
