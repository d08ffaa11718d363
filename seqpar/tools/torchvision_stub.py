"""Import timm where no torchvision works with the installed torch (a CPU-only torch).

timm imports torchvision at import time (``timm/layers/create_norm.py``: ``from torchvision.ops.misc
import FrozenBatchNorm2d``; ``timm.data`` subclasses torchvision transforms), and the registry may
have no torchvision built for a CPU-only torch (torch 2.13 CPU: torchvision 0.28.0's wheel links
``libtorch_cuda.so``). Then ``import timm`` fails with ``No module named 'torchvision'``. None of
that is on the forward path of timm's ViT, DeiT and EVA models, so::

    from seqpar.tools.torchvision_stub import import_timm

    timm, why = import_timm()        # why: None if a real torchvision was used, else the reason

imports timm behind a **stand-in** for torchvision whose every object raises when *used* (called),
and only for the duration of that import: afterwards ``import torchvision`` fails as it did before.
Nothing here happens on ``import seqpar``; call :func:`import_timm` yourself, before any
``import timm``. With a working torchvision it is a plain ``import timm``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__all__ = ["import_timm", "torchvision_problem"]


class _Absent:
    """A torchvision name that timm binds at import time; calling it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Absent:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"{self._name} is a stand-in (seqpar.tools.torchvision_stub): no torchvision works with this "
            "torch; install a torchvision built for it to use this part of timm"
        )

    def __mro_entries__(self, bases: tuple) -> tuple[type, ...]:  # timm.data subclasses transforms
        return (object,)


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Absent:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self.__name__}.{attr}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandInModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def _forget(prefix: str) -> None:
    for name in [m for m in sys.modules if m == prefix or m.startswith(prefix + ".")]:
        del sys.modules[name]


def torchvision_problem() -> str | None:
    """Why torchvision does not import here (``"ModuleNotFoundError: ..."``), or ``None`` if it does."""
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # missing, or built for another torch (its C ops fail to register)
        _forget("torchvision")
        return f"{type(e).__name__}: {str(e)[:100]}"
    return None


def import_timm(stand_in: bool = True) -> tuple[types.ModuleType, str | None]:
    """Import timm, behind a torchvision stand-in when no torchvision works here.

    Args:
        stand_in: allow the stand-in; ``False`` raises instead (a plain ``import timm``).

    Returns:
        ``(timm, why)``: ``why`` says why torchvision was stood in for, ``None`` if it was not
        (a working torchvision).

    Raises:
        ImportError: timm is not installed (``pip install --no-deps timm==1.0.31``), or no
            torchvision works and ``stand_in`` is false.
    """
    why = torchvision_problem()
    if why is None:
        import timm

        return timm, None
    if not stand_in:
        raise ImportError(
            f"timm imports torchvision, which does not import here ({why}); install a torchvision built for "
            "this torch, or call seqpar.tools.torchvision_stub.import_timm(stand_in=True)"
        )
    finder = _StandInFinder()
    sys.meta_path.insert(0, finder)
    try:
        import timm
    finally:
        sys.meta_path.remove(finder)
        _forget("torchvision")  # later imports of torchvision fail as they would have
    return timm, why
