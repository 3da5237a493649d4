"""Live-storage accounting for memory tests on CPU: each storage counted once, by address."""

from __future__ import annotations

import gc
import warnings
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def live_storages() -> dict[int, int]:
    """{storage address: bytes} of every tensor the garbage collector can see (each storage once)."""
    gc.collect()
    out = {}
    with warnings.catch_warnings():  # isinstance on deprecated module attributes warns
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        try:
            st = obj.untyped_storage()
            if st.device.type == "cpu" and st.nbytes():
                out[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):  # DTensors, freed storages: their locals are seen
            continue
    return out


class LiveBytes(TorchDispatchMode):
    """Inside the block: bytes of live storages, those alive at entry and every storage an op
    creates, each until it is freed (weak references to the storages); ``peak`` the most."""

    def __enter__(self):
        self.live: dict[int, int] = {}
        gc.collect()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        for obj in objects:
            try:
                self._track(obj.untyped_storage())
            except (RuntimeError, NotImplementedError):
                continue
        self.peak = self.now
        return super().__enter__()

    @property
    def now(self) -> int:
        return sum(self.live.values())

    def _track(self, st) -> None:
        try:
            key = st.data_ptr()
        except RuntimeError:  # a storage FSDP freed (resized to nothing)
            return
        if st.device.type != "cpu" or not st.nbytes() or key in self.live:
            return
        self.live[key] = st.nbytes()
        weakref.finalize(st, self.live.pop, key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage())
        self.peak = max(self.peak, self.now)
        return out
