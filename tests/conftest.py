from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from seqpar.tools.testing import DistPool


# The collective timeout of every pool's default group (and of the states built on it): a rank left
# waiting in a collective fails its test within a minute rather than after torch's 30; no wait in
# these tests comes near it (the longest single run of a test function takes ~16 s here).
POOL_TIMEOUT_S = 60.0


class _Pools:
    """One lazily started ``DistPool`` per world size, shared by the whole test session: every
    spawn starts ranks that import torch afresh (and often transformers and the model families),
    seconds each on 2 cores, so one pool per size serves every test, refusal tests included."""

    def __init__(self) -> None:
        self._pools: dict[int, DistPool] = {}

    def __call__(self, world_size: int) -> DistPool:
        if world_size not in self._pools:
            self._pools[world_size] = DistPool(world_size, timeout_s=POOL_TIMEOUT_S)
        return self._pools[world_size]

    def close(self) -> None:
        # Together: each pool gives its ranks a moment to exit before stopping them.
        with ThreadPoolExecutor() as ex:
            list(ex.map(DistPool.close, self._pools.values()))


@pytest.fixture(scope="session")
def pools():
    p = _Pools()
    yield p
    p.close()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
