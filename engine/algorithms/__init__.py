"""Bagua's algorithms implemented natively on torch.distributed: one module and one registration each.

Importing the package imports every module in it, so an algorithm's file (with its
``@register_algorithm``) is all it takes to offer it to both front doors.
"""

import importlib as _importlib
import pkgutil as _pkgutil

for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")
