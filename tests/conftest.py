import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are built from configs; never downloaded

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (minutes each: the examples under torchrun) run only with
    DCPARALLEL_SLOW=1, so that `make test` stays within its ten minutes on 2 cores."""
    if os.environ.get("DCPARALLEL_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set DCPARALLEL_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
