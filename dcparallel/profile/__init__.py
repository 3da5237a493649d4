"""Measures a real model on this device: time and memory per bucket and layout, from stacks of
one and two layers extrapolated to full depth, gathered over the launch's ranks, cached as a
versioned `Profile` keyed by a fingerprint."""

from dcparallel.profile.cache import check_cached, fingerprint_diff, load_or_profile
from dcparallel.profile.inputs import Inputs, MakeInputs, model_spec, text_inputs, video_inputs
from dcparallel.profile.measure import SavedTensorMeter, active_depth, extrapolate
from dcparallel.profile.profiler import Profiler, ProfilerConfig, ProfileStats, representative_sizes

__all__ = [
    "Inputs",
    "MakeInputs",
    "ProfileStats",
    "Profiler",
    "ProfilerConfig",
    "SavedTensorMeter",
    "active_depth",
    "check_cached",
    "extrapolate",
    "fingerprint_diff",
    "load_or_profile",
    "model_spec",
    "representative_sizes",
    "text_inputs",
    "video_inputs",
]
