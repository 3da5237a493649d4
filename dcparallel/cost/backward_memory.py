"""What a micro-batch holds beyond its layers' kept activations, from the model's shapes.

A step's memory peaks in backward, not at the end of the forward: on top of the activations
kept for backward, backward allocates gradients of activations and workspaces that the forward
never holds. Two moments bound it (per rank, ``n`` tokens, ``a`` bytes per activation value):

* **the loss's backward** (text models): the cross-entropy (`dcparallel.loss`, chunks of at most
  `CE_CHUNK_BYTES` fp32 logits) holds the logits' gradient (n x vocab x a) while each chunk
  recomputes its fp32 log-softmax, the nll gradient and the log-softmax backward's output
  (three fp32 chunks), with every layer's activations and the logits still kept (then the
  head's matmul backward, with the logits' gradient, its input's and its weight's);
* **one layer's backward**: the gradients of the activations in flight inside the layer; with
  recomputation, also the layer's recomputed activations.

Every other moment of backward holds less: the logits and their gradient are freed before the
layers' backward starts, and each layer frees its own activations as it finishes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dcparallel.spec import ModelSpec

#: `dcparallel.loss.CE_CHUNK_BYTES` (the cost core imports no torch; a unit test keeps them equal)
CE_CHUNK_BYTES = 256 * 2**20
#: bytes of one fp32 value: the loss's log-softmax and the RMS norms' statistics are computed in fp32
FP32 = 4


def activation_bytes(model: ModelSpec) -> int:
    """Bytes of one activation value: 2 under autocast (its matmuls compute in 16 bits),
    else the parameters' (a model stored in fp32 keeps fp32 activations)."""
    return 2 if model.autocast_params else model.bytes_per_value


class OutputHeadBytes(NamedTuple):
    """A text model's bytes outside its layers, per rank."""

    #: kept from the forward until the loss's backward (`output_head_kept_bytes`)
    kept: float
    #: allocated by the loss's and the head's backward on top of everything kept
    #: (`loss_backward_bytes`)
    backward: float


def output_head_bytes(model: ModelSpec, n, array: bool = False) -> OutputHeadBytes:
    """`OutputHeadBytes` of ``n`` tokens per rank (a float, or an array of many micro-batches);
    zero for a model with no vocabulary (a video model's loss is on its latents)."""
    if not model.vocab_size:
        return OutputHeadBytes(0.0 * n, 0.0 * n)
    return OutputHeadBytes(output_head_kept_bytes(model, n), loss_backward_bytes(model, n, array))


def output_head_kept_bytes(model: ModelSpec, n) -> float:
    """Bytes a text model keeps outside its layers for ``n`` tokens: the logits (n x vocab x a);
    the final RMS norm's saved fp32 input, its normalized output in the activations' dtype and
    the weighted output the head's matmul saves (n x hidden x (4 + 2a)); the rotary
    embedding's cos and sin tables every layer's attention reads (n x 2 x head size x a); the
    token ids, labels and positions (int64), the loss's per-token values (fp32) and its mask
    (bool). Each layer's input is its own (`Calibration.act_full`)."""
    a = activation_bytes(model)
    d = model.head_dim or model.hidden // model.num_heads
    per_token = model.hidden * (FP32 + 2 * a) + 2 * d * a + 3 * 8 + FP32 + 1
    return n * per_token + n * model.vocab_size * a


def loss_backward_bytes(model: ModelSpec, n, array: bool = False) -> float:
    """Bytes the loss's and the output head's backward allocate for ``n`` tokens, the larger of:

    * the cross-entropy's backward: the logits' gradient (n x vocab x a) and, per chunk of at
      most `CE_CHUNK_BYTES` fp32 logits, three fp32 chunks alive at once (the recomputed
      log-softmax, the nll gradient and the log-softmax backward's output; under 16 bits the
      upcast copy of the chunk is freed before the third);
    * the head's matmul backward: the logits' gradient, the gradient of its input (n x hidden
      x a) and the weight's gradient (vocab x hidden, the parameters' bytes) autograd makes
      before it is added into the gradient buffer."""
    v, a = model.vocab_size, activation_bytes(model)
    rows = max(1, CE_CHUNK_BYTES // (FP32 * v))
    chunk = (np.minimum if array else min)(n, rows)
    larger = np.maximum if array else max
    return n * v * a + larger(3 * chunk * v * FP32, n * model.hidden * a + v * model.hidden * model.bytes_per_value)


def layer_backward_bytes(model: ModelSpec, n, array: bool = False) -> float:
    """The largest set of gradients one layer's backward holds at once, for ``n`` tokens per
    rank (a float, or an array of many micro-batches; a = activation bytes, b = the
    parameters'): the larger of its MLP's and its attention's.

    * MLP (gated): the gradient of the block's input (n x hidden x a) throughout; then three
      ``ffn_hidden``-wide gradients while the gate's product and the activation run backward
      (the product's, the activation's and the up projection's output's), or two while a
      projection's backward also makes its weight's gradient (hidden x ffn_hidden x b, before
      it is added into the gradient buffer). An ungated MLP holds one ffn-wide gradient fewer:
      this over-counts it;
    * attention: the gradients of the output projection's input, of q, k and v before and
      after the rotary embedding (q heads x head size, and k, v at the key/value heads) and of
      the block's input.

    For LLaMA-7B on the H200 (bf16, 4096+ tokens) this is 74.2 kB per token against the
    75.7 kB the packaged calibration measured as the layer's transient
    (`Calibration.transient_none` x its kept activations)."""
    a, f, h = activation_bytes(model), model.ffn_hidden, model.hidden
    d = model.head_dim or h // model.num_heads
    dv = model.v_head_dim or d
    q, kv = model.num_heads * d, model.kv_heads * (d + dv)
    larger = np.maximum if array else max
    mlp = n * h * a + larger(3 * n * f * a, 2 * n * f * a + h * f * model.bytes_per_value)
    attn = n * (model.num_heads * dv + 2 * (q + kv) + h) * a
    return larger(mlp, attn)
