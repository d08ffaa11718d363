import pytest
import torch

from seqpar.tools.testing import DistPool


class _Pools:
    """One lazily started ``DistPool`` per world size, shared by the whole test session."""

    def __init__(self) -> None:
        self._pools: dict[int, DistPool] = {}

    def __call__(self, world_size: int) -> DistPool:
        if world_size not in self._pools:
            self._pools[world_size] = DistPool(world_size)
        return self._pools[world_size]

    def close(self) -> None:
        for p in self._pools.values():
            p.close()


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
