"""The next-token loss convention every text path shares: labels are the inputs shifted by
one, ``IGNORE_INDEX`` where a position has no target (a document's last token, prompt tokens
of chat data, padding), and the unreduced cross-entropy with the mask of real targets.

The collate functions shift labels on the whole document before sharding (`data.collate`),
the chat reader marks non-assistant tokens (`data.text_data`), and the engine's ``lm_loss``
turns logits into the summed loss (`runtime.engine`); a model never computes its own loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

#: a label with no target (torch's cross-entropy default ``ignore_index``)
IGNORE_INDEX = -100


def shift_labels(tokens: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Next-token targets of one document (1-D): labels[i] = tokens[i+1], the last ignored."""
    labels = torch.full_like(tokens, ignore_index)
    labels[:-1] = tokens[1:]
    return labels


def per_token_loss(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """Unreduced cross-entropy (B, L) and the mask of real targets (B, L)."""
    loss = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), reduction="none", ignore_index=ignore_index
    ).view(labels.shape)
    return loss, labels != ignore_index
