"""Lazy public names for package ``__init__`` modules.

A package lists ``name -> module`` and binds the two hooks this returns as its module-level
``__getattr__`` / ``__dir__``; a name's module is imported on first use only, so importing a
package stays cheap (no torchrec, no native extension until a name needs it).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(
    package: str, names: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(``__getattr__``, ``__dir__``) for `package` resolving `names` (name -> module)."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted([*vars(sys.modules[package]), *names])

    return __getattr__, __dir__
