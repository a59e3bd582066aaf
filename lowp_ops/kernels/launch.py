"""Launching a Triton kernel without Triton's per-call launch path.

``kernel[grid](*args, **meta)`` in Triton 3.6 reads its environment knobs, binds the arguments, builds a
string key of their specialization and checks the kernel's globals on every call: tens of microseconds
of host time, several times the GPU time of a small kernel. :func:`cached_launch` wraps a ``@triton.jit``
kernel so that a call computes a tuple key of what Triton specializes on (each tensor's dtype and
16-byte alignment; each integer's value being 1, its divisibility by 16 and its width; the constexpr
and launch options as given) and, when Triton has compiled that specialization before, launches the
compiled binary Triton returned for it directly, through the binary's own launcher (the call
``CompiledKernel.__getitem__`` makes, without its per-call closure). The first call of a
specialization, and every call under ``TRITON_INTERPRET=1``, goes through Triton's own path (which
compiles and launches).

The key is at least as fine as Triton's: two calls with the same key are the same specialization, so
the binary launched is the one Triton itself would launch.

Inside a ``torch.compile`` graph an op whose kernels Inductor launches itself (``inline_kernels`` in
``library.py``) runs its launcher on traced tensors: each launch is then recorded through
``torch.library.wrap_triton`` instead (:meth:`CachedLaunch.launch`).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import ClassVar

import torch
import triton.language as tl
from triton import knobs

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
# The same flag for ``@triton.jit`` code, which reads module globals only as constexprs.
INTERPRETING_CONSTEXPR = tl.constexpr(INTERPRETING)
# Launch options of Triton's compiler, passed as keywords beside the constexprs; not kernel parameters.
_LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion"})
_INT32 = 2**31


def _run_time_args_key(args: tuple) -> tuple:
    """What Triton specializes run-time arguments on (types and properties, not values), per argument:
    a tensor's dtype and 16-byte alignment; an int's being 1, its divisibility by 16 and its width.
    One comprehension with no call per argument (4.9 -> 3.5 us for the 20 arguments of the CE backward
    on a 2-core CI-class CPU, against a function called per argument)."""
    return tuple(
        [
            (v.dtype, v.data_ptr() % 16 == 0)
            if isinstance(v, torch.Tensor)
            else (bool, v)
            if isinstance(v, bool)
            else (int, v == 1, v % 16 == 0, -_INT32 <= v < _INT32)
            if isinstance(v, int)
            else float
            if isinstance(v, float)
            else _value_key(v)
            for v in args
        ]
    )


def _exact_ints_args_key(args: tuple) -> tuple:
    """:func:`_run_time_args_key` with each int as its value (finer than Triton's key, so as correct):
    for bound launches, whose ints are their plan's constants; 1.9 against 3.2 us for 13 arguments."""
    return tuple(
        [
            v
            if type(v) is int
            else (v.dtype, v.data_ptr() % 16 == 0)
            if isinstance(v, torch.Tensor)
            else _arg_key(v)
            for v in args
        ]
    )


def _arg_key(value):
    """The key of one run-time argument (:func:`_run_time_args_key`)."""
    return _run_time_args_key((value,))[0]


def _value_key(value):
    """A constexpr or launch option: its value is the key."""
    return value.value if isinstance(value, tl.constexpr) else value


class CachedLaunch:
    """A ``@triton.jit`` kernel launched through its compiled binaries (see the module docstring).

    ``kernel[grid](*args, **meta)`` as with the JIT function; every other attribute is the JIT
    function's. ``launches`` counts the launches (the tests freeze each public call's count)."""

    launches = 0

    def __init__(self, jit_function, fp_fusion: bool | None = True) -> None:
        self.jit_function = jit_function
        self.fp_fusion = fp_fusion  # the default of ``enable_fp_fusion`` (:func:`cached_launch`)
        self._binaries: dict = {}
        if INTERPRETING:  # an InterpretedFunction: every launch goes through Triton
            return
        params = jit_function.params
        self._names = [p.name for p in params]
        self._defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        constexpr = {p.name for p in params if p.is_constexpr} | _LAUNCH_OPTIONS
        self._key_of = [_value_key if p.name in constexpr else _arg_key for p in params]
        # Positional arguments before the first constexpr are all run-time ones (the fast key).
        self._run_time_prefix = next((i for i, p in enumerate(params) if p.name in constexpr), len(params))
        self._meta_run_time = frozenset(name for name in self._names if name not in constexpr)

    def __getattr__(self, name):
        return getattr(self.jit_function, name)

    def __getitem__(self, grid):
        fusion = self.fp_fusion
        if fusion is None:
            return lambda *args, **meta: self.launch(grid, args, meta)

        def pinned(*args, **meta):
            meta.setdefault("enable_fp_fusion", fusion)
            self.launch(grid, args, meta)

        return pinned

    def bind(self, grid, *, exact_ints: bool = True, **meta) -> BoundLaunch:
        """This kernel with ``grid`` and ``meta`` (constexprs and launch options only) fixed: calling the
        result with the run-time arguments launches as ``self[grid](*args, **meta)`` would, without
        building the keywords' part of the key on every call (for launchers that keep one per input
        specialization). ``exact_ints``: key ints by value (faster; a binary entry per value), else as
        Triton does (for ints that vary between calls, such as a row count: no new entry, and no trip
        through Triton's launch path, per value)."""
        if self.fp_fusion is not None:
            meta.setdefault("enable_fp_fusion", self.fp_fusion)
        return BoundLaunch(self, grid, meta, exact_ints)

    def _meta_key(self, meta: dict) -> tuple:
        run_time = self._meta_run_time
        # A constexpr or launch option is its own key (no call per keyword: most launches pass 5-12).
        return tuple(
            [
                (name, _arg_key(value))
                if name in run_time
                else (name, value.value if type(value) is tl.constexpr else value)
                for name, value in meta.items()
            ]
        )

    def launch(self, grid, args: tuple, meta: dict, bound: BoundLaunch | None = None) -> None:
        if _traced(args):
            # AOTAutograd traces the launcher: Inductor gets the kernel call and launches it itself.
            torch.library.wrap_triton(self.jit_function)[grid](*args, **meta)
            return
        CachedLaunch.launches += 1
        if INTERPRETING:
            self.jit_function[grid](*args, **meta)
            return
        device = torch._C._cuda_getDevice()  # CUDA is initialized: the arguments are CUDA tensors
        if bound is not None:
            args_key = _exact_ints_args_key(args) if bound.exact_ints else _run_time_args_key(args)
        elif len(args) <= self._run_time_prefix:
            args_key = _run_time_args_key(args)
        else:
            key_of = self._key_of
            args_key = tuple([key_of[i](value) for i, value in enumerate(args)])
        meta_key = self._meta_key(meta) if bound is None else bound.meta_key
        key = (device, args_key, meta_key)
        entry = self._binaries.get(key)
        if entry is None:
            # Triton compiles (or finds) the binary, launches it and returns it.
            binary = self.jit_function[grid](*args, **meta)
            self._binaries[key] = None if binary is None else (binary, binary.run, binary.function)
            return
        binary, run, function = entry
        if bound is not None and bound.arg_count == len(args):
            full_args = [*args, *bound.trailing]
        else:
            full_args = list(args)
            for name in self._names[len(args) :]:
                full_args.append(meta[name] if name in meta else self._defaults[name])
        grid_0, grid_1, grid_2 = (*grid, 1, 1)[:3]
        stream = torch._C._cuda_getCurrentRawStream(device)
        enter, leave = (
            _active_hook(knobs.runtime.launch_enter_hook),
            _active_hook(knobs.runtime.launch_exit_hook),
        )
        metadata = None
        if enter is not None or leave is not None:
            metadata = binary.launch_metadata((grid_0, grid_1, grid_2), stream, *full_args)
        run(
            grid_0,
            grid_1,
            grid_2,
            stream,
            function,
            binary.packed_metadata,
            metadata,
            enter,
            leave,
            *full_args,
        )


class BoundLaunch:
    """A :class:`CachedLaunch` with its grid and keywords fixed (:meth:`CachedLaunch.bind`); called with
    the run-time arguments, positionally."""

    __slots__ = ("arg_count", "exact_ints", "grid", "kernel", "meta", "meta_key", "trailing")

    def __init__(self, kernel: CachedLaunch, grid, meta: dict, exact_ints: bool = True) -> None:
        self.kernel, self.grid, self.meta, self.exact_ints = kernel, grid, meta, exact_ints
        self.meta_key = None if INTERPRETING else kernel._meta_key(meta)
        # The parameters after the run-time ones, in order (the keywords and the defaults), filled in
        # at the first call, which fixes how many run-time arguments a call passes.
        self.arg_count, self.trailing = -1, ()

    def __call__(self, *args) -> None:
        if self.arg_count != len(args) and not INTERPRETING:
            kernel = self.kernel
            names = kernel._names[len(args) :]
            self.trailing = tuple(self.meta[n] if n in self.meta else kernel._defaults[n] for n in names)
            self.arg_count = len(args)
        self.kernel.launch(self.grid, args, self.meta, self)


class PlanCache:
    """A launcher's plans, one per key of what the plan depends on (shapes, strides, dtypes, devices,
    flags): ``cache.get(key, build, *args)`` returns the plan stored under ``key``, else ``build(*args)``
    (which checks the arguments; a build that raises stores nothing) stored under it. A launcher keeps
    per-call work (checks, output layouts, grids, bound launches) in its plans, so that a call only
    allocates and launches. Cleared when ``limit`` plans are stored (shapes that vary from step to step)."""

    instances: ClassVar[list[PlanCache]] = []  # every cache, for clear_plans

    def __init__(self, limit: int = 1024) -> None:
        self.plans: dict = {}
        self.limit = limit
        PlanCache.instances.append(self)

    def get(self, key: tuple, build: Callable, *args):
        plan = self.plans.get(key)
        if plan is None:
            plan = build(*args)
            if len(self.plans) >= self.limit:
                self.plans.clear()
            self.plans[key] = plan
        return plan


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """What a plan depends on of an optional tensor argument: its shape, strides, dtype and device."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def clear_plans() -> None:
    """Drop every launcher's plans (for tests that patch a module's configuration or kernels: a plan built
    before would keep the old ones)."""
    for cache in PlanCache.instances:
        cache.plans.clear()


def _traced(args: tuple) -> bool:
    """True when the first tensor argument is a tracer's (a functional or fake tensor), not real data."""
    for value in args:
        if isinstance(value, torch.Tensor):
            return type(value) is not torch.Tensor and type(value) is not torch.nn.Parameter
    return False


def _active_hook(hook):
    """``hook``, or None when there is nothing to call: Triton's knobs hold a ``HookChain`` (always truthy,
    possibly empty) where older releases held None or a function. With None the launch skips building
    the launch metadata and the two hook calls (several microseconds a launch)."""
    return None if hook is None or getattr(hook, "calls", True) == [] else hook


def cached_launch(jit_function=None, *, fp_fusion: bool | None = True):
    """Decorator over ``@triton.jit`` for kernels launched from Python (not for ``@triton.jit`` helpers
    that other kernels call): ``@cached_launch`` or ``@cached_launch(fp_fusion=None)``.

    ``fp_fusion``: the ``enable_fp_fusion`` (FMA contraction) a launch compiles the kernel with unless it
    passes its own. True, the default, is what every byte contract of the kernels was measured with:
    Triton's default up to 3.9, which Triton 3.10 turns off (Triton 3.9 warns), so an unpinned kernel
    would change its bytes with the Triton release. None leaves Triton's default, for the kernels that
    compiled graphs launch themselves (``inline_kernels`` in ``library.py``): Inductor passes no such
    option, and the eager launch must compile what Inductor does."""
    if jit_function is None:
        return lambda function: CachedLaunch(function, fp_fusion)
    return CachedLaunch(jit_function, fp_fusion)


def rows_with_unit_stride(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dim is unit-stride (the kernels read rows through their stride), else a
    contiguous copy (column-major input crashed the H200 kernels: they read row-major tiles only)."""
    return x if x.stride(-1) == 1 else x.contiguous()


__all__ = [
    "INTERPRETING",
    "INTERPRETING_CONSTEXPR",
    "BoundLaunch",
    "CachedLaunch",
    "PlanCache",
    "cached_launch",
    "clear_plans",
    "rows_with_unit_stride",
    "tensor_key",
]
