"""`ModelAdapter.skip_block` of the packed-latent image families (Flux.1, Flux 2, Qwen-Image
share one, `adapters.flux.skip_block`): called as the model calls each block, it returns the
block's own inputs in the structure the block returns, so the profiler's short stacks feed
the next block what a real block would."""

from __future__ import annotations

import pytest
import torch

from dcparallel.runtime.engine import Engine
from tests.adapter_models import build, make_data, predict

pytest.importorskip("diffusers")


def _streams(args: tuple, kwargs: dict) -> tuple:
    """(hidden_states, encoder_hidden_states or None) of one block call."""
    named = dict(zip(("hidden_states", "encoder_hidden_states"), args)) | kwargs
    return named["hidden_states"], named.get("encoder_hidden_states")


@pytest.mark.parametrize("kind", ["flux", "flux2", "qwenimage"])
def test_skip_block_returns_each_blocks_inputs_as_the_block_returns_them(kind):
    model = build(kind)
    skip = Engine(model).adapter.skip_block
    calls = []
    blocks = [*model.transformer_blocks, *getattr(model, "single_transformer_blocks", [])]
    hooks = [
        b.register_forward_hook(lambda m, a, kw, out: calls.append((a, kw, out)), with_kwargs=True) for b in blocks
    ]
    data = make_data(kind, 1, 0)
    with torch.no_grad():
        predict(model, kind, data.docs[0][None], torch.tensor(0.5), data.extras[0])
    for h in hooks:
        h.remove()
    assert len(calls) == len(blocks)
    for args, kwargs, out in calls:
        image, text = _streams(args, kwargs)
        got = skip(*args, **kwargs)
        if isinstance(out, tuple):  # both streams, text first
            assert text is not None and text.shape[1] != image.shape[1]
            assert isinstance(got, tuple) and len(got) == len(out) == 2
            assert got[0] is text and got[1] is image
            assert [g.shape for g in got] == [o.shape for o in out]
        else:  # Flux 2's single-stream blocks: the joint rows
            assert text is None and got is image and got.shape == out.shape
