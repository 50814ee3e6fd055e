"""A package's public names imported on first use (PEP 562), so that importing the package is
quick: `lowcomm --help` reads lowcomm and config, `lowcomm data prepare` reads data, and none of
them waits for torch until a name that needs it is asked for."""
from __future__ import annotations

import importlib
import importlib.util
from typing import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str | tuple[str, str]], namespace: dict,
                 submodules: bool = False) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The package's module-level `__getattr__` and `__dir__`; `exports` maps a name to its module
    (relative to the package) or to (module, its name there):

        __getattr__, __dir__ = lazy_exports(__name__, {"Comm": ".comm", "make_strategy": (".run.driver", "make_run")},
                                            globals())

    A name is imported from its module when first asked for and kept in `namespace` (the package's
    globals), so the next access does not come back here. With `submodules`, any other name that is
    a submodule of the package is imported as one (`lowcomm.strategies` without importing it first)."""
    def __getattr__(name: str):
        if name in exports:
            module, attr = exports[name] if isinstance(exports[name], tuple) else (exports[name], name)
            value = getattr(importlib.import_module(module, package), attr)
            namespace[name] = value
            return value
        if submodules and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
