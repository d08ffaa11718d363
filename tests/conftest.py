from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from seqpar.tools.testing import DistPool


# The collective timeout of the pools that tests of "no rank left waiting" ask for: a rank stuck in a
# collective fails the test in seconds rather than after the default pools' two minutes.
SHORT_TIMEOUT_S = 30.0


class _Pools:
    """One lazily started ``DistPool`` per world size and collective timeout, shared by the whole
    test session: every spawn starts ranks that import torch afresh (and often transformers), ~20 s
    each on a loaded 2-core machine."""

    def __init__(self) -> None:
        self._pools: dict[tuple[int, float | None], DistPool] = {}

    def __call__(self, world_size: int, timeout_s: float | None = None) -> DistPool:
        """The pool of ``world_size`` ranks; ``timeout_s`` (e.g. ``SHORT_TIMEOUT_S``) asks for one whose
        default group has that collective timeout instead of ``DistPool``'s default."""
        key = (world_size, timeout_s)
        if key not in self._pools:
            self._pools[key] = DistPool(world_size) if timeout_s is None else DistPool(world_size, timeout_s=timeout_s)
        return self._pools[key]

    def close(self) -> None:
        # Together: each pool gives its ranks a moment to exit before stopping them.
        with ThreadPoolExecutor() as ex:
            list(ex.map(DistPool.close, self._pools.values()))


@pytest.fixture(scope="session")
def pools():
    p = _Pools()
    yield p
    p.close()


@pytest.fixture(scope="session")
def short_pools(pools):
    """``short_pools(world_size)``: the session's pool of that size whose collective timeout is
    ``SHORT_TIMEOUT_S``, for tests that a rank left waiting must fail quickly."""
    return lambda world_size: pools(world_size, SHORT_TIMEOUT_S)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
