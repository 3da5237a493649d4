import pytest

from tests.dist.harness import Workers


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def workers(request, tmp_path_factory):
    w = Workers(request.param, tmp_path_factory.mktemp(f"rdv{request.param}"))
    yield w
    w.close()


@pytest.fixture(scope="module")
def workers2(tmp_path_factory):
    """Two ranks, for modules that run at one world size."""
    w = Workers(2, tmp_path_factory.mktemp("rdv-2"))
    yield w
    w.close()
