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


#: fp32 bytes of one chunk of the cross-entropy: its logits are upcast this many at a time
#: (256 MiB: 512 tokens of a 128k vocabulary), never all of them
CE_CHUNK_BYTES = 256 * 2**20


def per_token_loss(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """Unreduced cross-entropy (B, L), fp32, and the mask of real targets (B, L). Computed over
    chunks of tokens (`CE_CHUNK_BYTES` of fp32 logits each, forward and backward), so low-
    precision logits are never upcast whole; each token's value and gradient are
    ``F.cross_entropy``'s on the fp32 logits."""
    flat = logits.reshape(-1, logits.shape[-1])
    loss = _ChunkedCrossEntropy.apply(flat, labels.reshape(-1), ignore_index).view(labels.shape)
    return loss, labels != ignore_index


def _chunks(logits: Tensor):
    rows = max(1, CE_CHUNK_BYTES // (4 * max(1, logits.shape[-1])))
    return range(0, logits.shape[0], rows), rows


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of (N, vocab) logits, chunk by chunk. Backward recomputes each
    chunk's fp32 log-softmax and runs the kernels autograd runs for ``F.cross_entropy(x.float())``
    (nll's gradient: minus the upstream gradient at the label; then log-softmax's backward), so
    the gradient is the unchunked one, cast to the logits' dtype as ``.float()``'s backward does."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, ignore_index: int) -> Tensor:
        ctx.save_for_backward(logits, labels)
        ctx.ignore_index = ignore_index
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        starts, rows = _chunks(logits)
        for i in starts:
            out[i : i + rows] = F.cross_entropy(
                logits[i : i + rows].float(), labels[i : i + rows], reduction="none", ignore_index=ignore_index
            )
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor):
        logits, labels = ctx.saved_tensors
        grad = torch.empty_like(logits)
        starts, rows = _chunks(logits)
        for i in starts:
            lab = labels[i : i + rows]
            lsm = torch.log_softmax(logits[i : i + rows].float(), dim=-1)
            keep = lab != ctx.ignore_index
            g_nll = torch.zeros_like(lsm)
            g_nll[keep, lab[keep]] = -grad_loss[i : i + rows][keep].to(lsm.dtype)
            grad[i : i + rows] = torch.ops.aten._log_softmax_backward_data(g_nll, lsm, 1, torch.float32)
            del lsm, g_nll
        return grad, None, None
