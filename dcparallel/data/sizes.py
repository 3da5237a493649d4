"""The size reader: every sample's size from ``lengths``, validated, and the step budget check."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any, Union

from dcparallel.spec import ModelSpec, Size

#: lengths: one size per sample (token count, or (frames, height, width) of a video), or a
#: function of the sample index returning it (called once per sample, then cached)
Lengths = Union[Sequence[Any], Callable[[int], Any]]


def _bad_length(i: int, value: Any, why: str) -> ValueError:
    return ValueError(
        f"lengths[{i}] = {value!r} {why}; give each sample's size as a positive integer token "
        f"count, or (frames, height, width) of positive integers for a video"
    )


def _positive_int(i: int, whole: Any, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise _bad_length(i, whole, f"is not a number (a {type(v).__name__})")
    if isinstance(v, numbers.Integral):
        n = int(v)
    elif float(v).is_integer():
        n = int(v)
    else:
        raise _bad_length(i, whole, "is not an integer")
    if n <= 0:
        raise _bad_length(i, whole, "is not positive (a sample needs at least one token)")
    return n


def _one_size(i: int, value: Any) -> Size:
    v = value.tolist() if hasattr(value, "tolist") else value
    if isinstance(v, (list, tuple)):
        if len(v) != 3:
            raise _bad_length(i, value, f"has {len(v)} values, not 3")
        return tuple(_positive_int(i, value, x) for x in v)  # type: ignore[return-value]
    return _positive_int(i, value, v)


def check_step_budget(tokens_per_step: Any, samples_per_step: Any) -> None:
    """Exactly one of the two, a positive integer (checked before anything is profiled)."""
    if (tokens_per_step is None) == (samples_per_step is None):
        raise ValueError(
            f"give exactly one of tokens_per_step or samples_per_step; got "
            f"tokens_per_step={tokens_per_step!r}, samples_per_step={samples_per_step!r}"
        )
    for name, v in (("tokens_per_step", tokens_per_step), ("samples_per_step", samples_per_step)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0):
            raise ValueError(f"{name} must be a positive integer; got {v!r}")


def read_sizes(lengths: Lengths, num_samples: int) -> tuple[Size, ...]:
    """Every sample's size, validated: `lengths` as a sequence (one entry per sample) or a
    function of the index (called once per index)."""
    if callable(lengths):
        values = [lengths(i) for i in range(num_samples)]
    else:
        try:
            count = len(lengths)
        except TypeError:
            raise ValueError(
                f"lengths must be a sequence with one size per sample or a function of the sample "
                f"index; got a {type(lengths).__name__}"
            ) from None
        if count != num_samples:
            raise ValueError(
                f"lengths has {count} entries but the dataset has {num_samples} samples; give one "
                f"size per sample, lengths[i] = the size of dataset[i]"
            )
        values = [lengths[i] for i in range(num_samples)]
    return tuple(_one_size(i, v) for i, v in enumerate(values))


def check_kind(sizes: Sequence[Size], model: ModelSpec) -> None:
    """Token counts for a text model, (frames, height, width) shapes for a video model."""
    wrong = next((i for i, s in enumerate(sizes) if isinstance(s, tuple) != (model.kind == "video")), None)
    if wrong is not None:
        want = "(frames, height, width) video shapes" if model.kind == "video" else "token counts"
        raise ValueError(
            f"lengths[{wrong}] = {sizes[wrong]!r}, but the model {model.name!r} is a {model.kind} model: give {want}"
        )
