import pytest

from tests.dist.harness import Workers


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def workers(request, tmp_path_factory):
    w = Workers(request.param, tmp_path_factory.mktemp(f"rdv{request.param}"))
    yield w
    w.close()
