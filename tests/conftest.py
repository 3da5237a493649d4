import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are built from configs; never downloaded
# cost="analytic" prices with the packaged calibration: plans the same on every machine and run
os.environ.setdefault("DCPARALLEL_CPU_CALIBRATION", "0")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run: a failure reproduces as it was seen, and
# whether `make test` (CI's run) passes does not depend on the draw. HYPOTHESIS_PROFILE=explore
# draws new examples each run, to look for failures the fixed draw does not meet.
settings.register_profile("repeatable", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

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
