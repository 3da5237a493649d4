"""Video datasets of precomputed latents: a manifest (CSV or JSONL, one row per clip) naming
the clip's VAE latents (C, frames, height, width) and text-encoder embeddings (tokens, dim)
in safetensors or ``.pt`` files, paths relative to the manifest.

    dataset, sizes = latents_dataset("clips.jsonl", channels=16, text_dim=4096)
    loader = dc.prepare(dataset, lengths=sizes, tokens_per_step=2**16)

Manifest columns: ``latents`` and ``text_embeddings`` (file paths; names configurable),
optionally ``frames``, ``height``, ``width`` (the latent shape), and extra conditioning
columns named in ``extra_columns`` (e.g. image latents), each a file loaded into the item
under its column name. Sizes come from the frames / height / width columns or, where a row
lacks them, from the latent file's header (a safetensors header is read without the data; a
``.pt`` file is memory-mapped); every file's header is checked against the manifest before
training. Items: ``{"latents": (C, F, H, W), "encoder_hidden_states": (T, D), **extras}``;
the diffusers adapters' collate stacks every key into ``Batch.extras``, and a model's default
loss passes the conditioning the model takes (e.g. Wan image-to-video's
``encoder_hidden_states_image`` or ``condition``: name the columns so) and refuses any other
key; a column for something else needs a ``loss_fn`` of the user's own that uses it.
A file holding several tensors names the one to use by the column (or "latents" /
"text_embeddings" / "encoder_hidden_states").
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from dcparallel.data.readers import BadData, Row, read_rows

SHAPE_COLUMNS = ("frames", "height", "width")
_KEYS = ("latents", "text_embeddings", "encoder_hidden_states")


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header (8-byte length + JSON), data not read."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            raise ValueError(f"{path} is not a safetensors file (header length {n})")
        meta = json.loads(f.read(n))
    return {k: tuple(v["shape"]) for k, v in meta.items() if k != "__metadata__"}


def _pick(named: dict[str, Any], column: str, path: Path) -> Any:
    if len(named) == 1:
        return next(iter(named.values()))
    for k in (column, *_KEYS):
        if k in named:
            return named[k]
    raise ValueError(f"{path} holds the tensors {sorted(named)}; name one {column!r} (or hold a single tensor)")


def tensor_shape(path: Path, column: str) -> tuple[int, ...]:
    """The shape of the file's tensor without reading its data (safetensors header, or a
    memory-mapped ``.pt``)."""
    if path.suffix == ".safetensors":
        return _pick(_safetensors_shapes(path), column, path)
    if path.suffix == ".pt":
        import torch

        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return tuple(_pick(obj if isinstance(obj, dict) else {column: obj}, column, path).shape)
    raise ValueError(f"{path}: latents and embeddings are .safetensors or .pt files, not {path.suffix!r}")


def load_tensor(path: Path, column: str) -> Any:
    import torch

    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return _pick(load_file(str(path)), column, path)
    obj = torch.load(path, map_location="cpu", weights_only=True)
    return _pick(obj if isinstance(obj, dict) else {column: obj}, column, path)


class LatentsDataset:
    """Map-style dataset of the good rows of a manifest: ``files[i]`` (column -> path)."""

    def __init__(self, rows: list[Row], files: list[dict[str, Path]], text_column: str, text_tokens: list[int]):
        self.rows, self.files, self.text_column = rows, files, text_column
        self.text_tokens = text_tokens  # text embedding tokens per clip (from the headers)

    def __len__(self) -> int:
        return len(self.files)

    def where(self, i: int) -> str:
        return self.rows[i].where

    def __getitem__(self, i: int) -> dict:
        item = {}
        for column, path in self.files[i].items():
            t = load_tensor(path, column).float()
            key = "encoder_hidden_states" if column == self.text_column else column
            item[key] = t
        return item


def _check_row(
    row: Row,
    base: Path,
    columns: tuple[str, ...],
    latents_column: str,
    text_column: str,
    channels: int | None,
    text_dim: int | None,
) -> tuple[dict[str, Path], tuple[int, int, int], int]:
    """The row's files, latent shape (frames, height, width) and text tokens; ValueError with
    the problem."""
    v = row.value
    files = {}
    for c in columns:
        if c not in v or v[c] in (None, ""):
            raise ValueError(f"no {c!r} column (columns: {sorted(v)})")
        files[c] = base / str(v[c])
        if not files[c].is_file():
            raise ValueError(f"{c} file {files[c]} does not exist")
    shape = tensor_shape(files[latents_column], latents_column)
    if len(shape) != 4:
        raise ValueError(
            f"latents {files[latents_column]} has shape {shape}; latents are (channels, frames, height, width)"
        )
    if 0 in shape:
        raise ValueError(f"latents {files[latents_column]} are empty (shape {shape})")
    if channels is not None and shape[0] != channels:
        raise ValueError(f"latents {files[latents_column]} have {shape[0]} channels; the model takes {channels}")
    if any(c in v for c in SHAPE_COLUMNS):
        try:
            listed = tuple(int(v[c]) for c in SHAPE_COLUMNS)
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"frames / height / width must all be integers, got {[v.get(c) for c in SHAPE_COLUMNS]}"
            ) from None
        if listed != tuple(shape[1:]):
            raise ValueError(
                f"the manifest says (frames, height, width) = {listed} but {files[latents_column]} "
                f"holds latents of shape {shape}"
            )
    text = tensor_shape(files[text_column], text_column)
    if len(text) != 2 or 0 in text:
        raise ValueError(f"text embeddings {files[text_column]} have shape {text}; expected (tokens, dim)")
    if text_dim is not None and text[1] != text_dim:
        raise ValueError(f"text embeddings {files[text_column]} have dim {text[1]}; the model takes {text_dim}")
    return files, (int(shape[1]), int(shape[2]), int(shape[3])), int(text[0])


def latents_dataset(
    manifest: str | Path,
    *,
    latents_column: str = "latents",
    text_column: str = "text_embeddings",
    extra_columns: tuple[str, ...] | list[str] = (),
    channels: int | None = None,
    text_dim: int | None = None,
    skip_bad: bool = False,
) -> tuple[LatentsDataset, list[tuple[int, int, int]]]:
    """The dataset of a latents manifest (.csv or .jsonl) and every clip's latent shape
    (frames, height, width). Every row is checked first (files exist, shapes agree with the
    manifest and, when given, the model's ``channels`` / ``text_dim``); bad rows raise one
    error naming each (file:line) or, with ``skip_bad``, are dropped and logged."""
    p = Path(manifest)
    if p.suffix.lower() not in (".csv", ".jsonl", ".json"):
        raise ValueError(f"the latents manifest {p} must be .csv or .jsonl (one row per clip)")
    rows = read_rows(p)
    if not rows:
        raise ValueError(f"the manifest {p} holds no clips")
    columns = (latents_column, text_column, *extra_columns)
    bad = BadData(str(p), skip_bad)
    good, files, sizes, tokens = [], [], [], []
    for row in rows:
        try:
            f, size, num_text = _check_row(row, p.parent, columns, latents_column, text_column, channels, text_dim)
        except ValueError as exc:
            bad.add(row.where, str(exc))
            continue
        good.append(row)
        files.append(f)
        sizes.append(size)
        tokens.append(num_text)
    bad.finish(len(rows))
    if not good:
        raise ValueError(f"{p}: every one of its {len(rows)} clips is bad")
    return LatentsDataset(good, files, text_column, tokens), sizes
