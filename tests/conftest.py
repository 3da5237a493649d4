import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are built from configs; never downloaded
# cost="analytic" prices with the packaged calibration: plans the same on every machine and run
os.environ.setdefault("DCPARALLEL_CPU_CALIBRATION", "0")

import pytest  # noqa: E402

from tests.schedule import longest_first  # noqa: E402


# last: after pytest has grouped each module's tests by their module-scoped fixtures' parameters
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (minutes each: the examples under torchrun) run only with
    DCPARALLEL_SLOW=1, so that `make test` stays within its ten minutes on 2 cores. The
    longest modules come first (`tests.schedule`: what the xdist workers start first)."""
    longest_first(items)
    if os.environ.get("DCPARALLEL_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set DCPARALLEL_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
