"""The import hook that makes ``mooncake.store`` HKVM's.

The wheel installs ``hkvm_mooncake.pth`` beside the package; Python runs it at
start-up and it calls :func:`install`, which puts two finders on ``sys.meta_path``:

- one first, claiming only ``mooncake.store``: it is served by
  :mod:`hkvm.mooncake_store`, which picks HKVM or the real Mooncake wheel at
  ``setup`` from the address (every other ``mooncake.*`` module still comes from
  the wheel);
- one last, claiming ``mooncake`` only when nothing else provides it (no Mooncake
  wheel installed): an empty package, so that ``import mooncake.store`` works.

``HKVM_MOONCAKE=off`` in the environment leaves ``mooncake`` entirely to the
wheel. This module imports nothing but the standard library: it runs in every
interpreter of the environment.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Optional, Sequence

#: The environment variable that selects the backend of ``mooncake.store``:
#: ``auto`` (the default: the setup address decides), ``hkvm`` (always HKVM),
#: ``mooncake`` (always the wheel, through HKVM's module) or ``off`` (the hook is
#: not installed: ``mooncake.store`` is the wheel's own module).
MODE_VARIABLE = "HKVM_MOONCAKE"
STORE = "mooncake.store"
PACKAGE = "mooncake"


def mode() -> str:
    """The backend choice the environment asks for (see :data:`MODE_VARIABLE`)."""
    value = os.environ.get(MODE_VARIABLE, "auto").strip().lower()
    return value if value in ("auto", "hkvm", "mooncake", "off") else "auto"


class _StoreLoader(importlib.abc.Loader):
    """Loads ``mooncake.store`` as a copy of :mod:`hkvm.mooncake_store`'s names."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return None

    def exec_module(self, module: ModuleType) -> None:
        from . import mooncake_store

        for name in mooncake_store.__all__:
            setattr(module, name, getattr(mooncake_store, name))
        module.__all__ = list(mooncake_store.__all__)
        module.__doc__ = mooncake_store.__doc__
        # Names HKVM does not define come from the wheel, when it is installed.
        module.__getattr__ = mooncake_store.__getattr__  # type: ignore[attr-defined]


class _StoreFinder(importlib.abc.MetaPathFinder):
    """Claims ``mooncake.store``, first on ``sys.meta_path``."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != STORE:
            return None
        return importlib.util.spec_from_loader(fullname, _StoreLoader(), origin="hkvm.mooncake_store")


class _EmptyPackageLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return None

    def exec_module(self, module: ModuleType) -> None:
        module.__doc__ = "Stand-in for the Mooncake package (not installed): holds HKVM's mooncake.store."


class _PackageFinder(importlib.abc.MetaPathFinder):
    """Claims ``mooncake``, last on ``sys.meta_path``: asked only when no other
    finder has it."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != PACKAGE:
            return None
        spec = importlib.machinery.ModuleSpec(PACKAGE, _EmptyPackageLoader(), is_package=True)
        spec.submodule_search_locations = []
        return spec


def installed() -> bool:
    """Whether the hook is on ``sys.meta_path``."""
    return any(isinstance(finder, _StoreFinder) for finder in sys.meta_path)


def install() -> None:
    """Puts the finders on ``sys.meta_path`` (once), unless ``HKVM_MOONCAKE=off``."""
    if mode() == "off" or installed():
        return
    sys.meta_path.insert(0, _StoreFinder())
    sys.meta_path.append(_PackageFinder())


def real_store() -> Optional[ModuleType]:
    """The Mooncake wheel's own ``store`` extension module, loaded (once) beside
    HKVM's ``mooncake.store``; None when the wheel is not installed."""
    cached = sys.modules.get("hkvm._mooncake_wheel_store")
    if cached is not None:
        return cached
    package = sys.modules.get(PACKAGE)
    if package is None:
        try:
            import mooncake as package  # noqa: F811 - the parent of mooncake.store
        except ImportError:
            return None
    search = list(getattr(package, "__path__", []) or [])
    if not search:
        return None
    spec = importlib.machinery.PathFinder.find_spec(STORE, search)
    if spec is None or spec.loader is None:
        return None
    # An extension module of single-phase initialisation (pybind11's) enters
    # itself into sys.modules under its spec's name as it loads: put HKVM's
    # module (or its absence) back.
    shim = sys.modules.get(STORE)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if shim is not None:
            sys.modules[STORE] = shim
        elif sys.modules.get(STORE) is not None and not _is_shim(sys.modules[STORE]):
            del sys.modules[STORE]
    sys.modules["hkvm._mooncake_wheel_store"] = module
    return module


def _is_shim(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return isinstance(getattr(spec, "loader", None), _StoreLoader)
