"""A user's function by `package.module:function`: how a job names its own reward or env."""
from __future__ import annotations

import importlib
from collections.abc import Callable


def import_function(path: str, what: str, where: str) -> Callable:
    """The callable at `path` ("package.module:function"); `what` names it in errors ("reward
    'x.y:z'"), `where` says which ranks import it."""
    module, _, attribute = path.partition(":")
    try:
        function = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what}: cannot import it ({exc}); the module must be importable on {where} "
                         "(installed, or on PYTHONPATH)") from None
    if not callable(function):
        raise ValueError(f"{what} is not a function")
    return function
