"""Writer plugins: the interface and the registry are in base.py; each output form is one module
here that registers itself with `@register(name)`. Importing the package imports them all, so
`WRITERS` maps every form's name to its class."""
import importlib
import pkgutil

from .base import WRITERS

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["WRITERS"]
