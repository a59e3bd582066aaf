"""Patched forwards bound to their modules as methods: one compiled graph for every instance, and a
patched model that pickles.

:func:`bind` stores a ``types.MethodType`` on the instance. Dynamo guards a bound method by its
function, so the decoder layers of a model (each with its own patched MLP and norms) share one graph
under regional compilation (``layer.compile()`` on every layer), and a second model of the class reuses
the first one's. A ``functools.partial`` there is guarded by its identity: one graph per layer and,
past Dynamo's recompile limit (8), the remaining layers run uncompiled.

A bound method pickles as ``getattr(module, function.__name__)``, which the module does not have: the
first :func:`bind` registers a pickle reducer for bound methods (``copyreg``) that reduces lowp's to
:func:`bind` of the function and the module, and every other method as before (through the reducer
registered earlier, if any).
"""

from __future__ import annotations

import copyreg
import inspect
import types
import weakref
from collections.abc import Callable

from torch import nn

# The per-class copies of functions that carry a ``signature_of`` (see :func:`bind`), by class.
_CLASS_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_reducer_registered = False


def bind(function: Callable, module: nn.Module) -> types.MethodType:
    """``function`` bound to ``module``, for an instance attribute (``module.forward = bind(f, module)``).

    ``function`` is a module-level function taking the module first. A ``signature_of`` attribute on it
    (``cls -> inspect.Signature``, ``self`` included) gives the method the signature of ``module``'s class:
    the method then runs a copy of ``function`` made once per class (the same code)."""
    _register_reducer()
    signature_of = getattr(function, "signature_of", None)
    if signature_of is not None:
        function = _class_copy(function, type(module), signature_of)
    else:
        function.lowp_function = function
    return types.MethodType(function, module)


def bound_function(value) -> Callable | None:
    """The function :func:`bind` bound in ``value`` (the original of a per-class copy); None for any other
    value, a method of the module's class included."""
    if not isinstance(value, types.MethodType):
        return None
    return getattr(value.__func__, "lowp_function", None)


def _class_copy(function: Callable, cls: type, signature_of: Callable[[type], inspect.Signature]):
    copies = _CLASS_COPIES.setdefault(cls, {})
    copy = copies.get(function)
    if copy is None:
        copy = types.FunctionType(function.__code__, function.__globals__, function.__name__)
        for name in ("__defaults__", "__kwdefaults__", "__qualname__", "__module__", "__doc__"):
            setattr(copy, name, getattr(function, name))
        copy.__signature__ = signature_of(cls)
        copy.lowp_function = function
        copies[function] = copy
    return copy


def _register_reducer() -> None:
    global _reducer_registered
    if _reducer_registered:
        return
    earlier = copyreg.dispatch_table.get(types.MethodType)

    def reduce_method(method: types.MethodType):
        function = bound_function(method)
        if function is not None:
            return bind, (function, method.__self__)  # the function pickled by reference
        return earlier(method) if earlier is not None else method.__reduce__()

    copyreg.pickle(types.MethodType, reduce_method)
    _reducer_registered = True
