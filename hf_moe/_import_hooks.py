"""Run a function when a module is first imported (or now, if it already is).

`import hf_moe` patches `transformers.Trainer` and `accelerate.Accelerator`. Importing those modules costs over a
second, which a user who only converts or generates should not pay, so the patches are applied when the user's
own code imports them.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable

_hooks: dict[str, list[Callable]] = {}
_lock = threading.Lock()


def when_imported(name: str, hook: Callable[[object], None]) -> None:
    """Call `hook(module)` once module `name` is imported: now if it already is, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        hook(module)
        return
    with _lock:
        _hooks.setdefault(name, []).append(hook)
        if _Finder.instance not in sys.meta_path:
            sys.meta_path.insert(0, _Finder.instance)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the real loader of a hooked module to run the hooks after it executes."""

    instance: _Finder

    def find_spec(self, fullname, path, target=None):
        if fullname not in _hooks:
            return None
        sys.meta_path.remove(self)  # ask the other finders for the real spec
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        with _lock:
            hooks = _hooks.pop(module.__name__, [])
        for hook in hooks:
            hook(module)


_Finder.instance = _Finder()
