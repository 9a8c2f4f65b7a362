"""Stand-ins for optional packages the zoo's models import but never run.

timm imports torchvision at import time (transforms, ``FrozenBatchNorm2d``) for its data pipeline and a few
convolutional models; the ViT family, which the zoo builds, runs none of it. Where torchvision is not
installed (its wheels here are CUDA builds), ``torchvision_stub()`` makes ``import torchvision...`` succeed with
placeholder modules; anything actually used from them raises ``ImportError`` naming the package to install.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _PlaceholderType(type):
    def __getattr__(cls, name: str):  # enum-like members (``InterpolationMode.NEAREST``): a name, hashable
        if name.startswith("__"):
            raise AttributeError(name)
        return f"{cls.__name__}.{name}"


class _Placeholder(metaclass=_PlaceholderType):
    """A name imported from a stubbed package: a class (subclassable, with attributes such as enum members)
    that refuses to be called."""

    def __init__(self, *args, **kwargs):
        raise ImportError(f"{type(self).__qualname__} needs torchvision; install it with pip install torchvision")


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        placeholder = type(name, (_Placeholder,), {"__module__": self.__name__})
        setattr(self, name, placeholder)
        return placeholder


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, package: str):
        self.package = package

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.package or fullname.startswith(self.package + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0"
        return module

    def exec_module(self, module):
        pass


def torchvision_stub() -> bool:
    """Make ``import torchvision`` succeed for timm's imports when torchvision is not installed (for the rest
    of the process: timm keeps what it imported). Returns whether the stub was installed."""
    if importlib.util.find_spec("torchvision") is not None or any(isinstance(f, _StubFinder) for f in sys.meta_path):
        return False
    sys.meta_path.append(_StubFinder("torchvision"))
    return True


def refresh_transformers_checks() -> None:
    """transformers caches whether torchvision and timm are importable; after the stub is installed, ask again."""
    utils = sys.modules.get("transformers.utils.import_utils")
    for name in ("is_torchvision_available", "is_timm_available", "is_torchvision_v2_available"):
        check = getattr(utils, name, None)
        if hasattr(check, "cache_clear"):
            check.cache_clear()
