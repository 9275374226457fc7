"""Short public names for modules that live in sub-packages (`hexiseq.nn` is `hexiseq.runtime.nn`): one module
object under both names, so classes, isinstance checks and module state are shared, and nothing is imported before
it is first asked for."""

import importlib
import importlib.abc
import importlib.util
import sys


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias by importing its target and handing back that very module object."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass  # the target ran when it was imported


class _AliasFinder(importlib.abc.MetaPathFinder):
    def __init__(self, aliases):
        self.aliases = aliases  # {"hexiseq.nn": "hexiseq.runtime.nn", ...}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.aliases:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(self.aliases[fullname]))


def install_module_aliases(package: str, aliases) -> None:
    """Make `package.short` import as `package.target` for each short -> target (dotted, relative to package)."""
    full = {f"{package}.{short}": f"{package}.{target}" for short, target in aliases.items()}
    if not any(isinstance(f, _AliasFinder) and f.aliases == full for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder(full))
