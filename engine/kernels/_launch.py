"""Kernel launches at a few microseconds of host time, and the launchers' scratch buffers.

A launch through Triton's JIT (``kernel[grid](*args)``) binds the arguments, derives their
specialisation (dtypes, 16-byte alignment of each pointer, integers equal to 1 or divisible by
16) and looks the compiled kernel up, on every call: tens of microseconds of Python on a
server CPU, more than the GPU spends on a bucket of 25 MiB. The launchers of this package
build a :class:`Launch` per layout (shapes, dtypes, alignments, block size: everything the
specialisation depends on is in the layout's key), launch it once through the JIT, and from
then on call the compiled kernel's own launcher (``CompiledKernel.run``, Triton's C function
around ``cuLaunchKernelEx``) with the same arguments, as the JIT itself does after its lookup,
the tensors passed by address.

The direct call is taken only where it is the JIT's own call: a compiled kernel (not Triton's
interpreter), no launch hooks installed (a profiler's hooks get the JIT's path). Anything else
goes through the JIT, every time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import torch


class _Direct(NamedTuple):
    launcher: Callable[..., Any]  # CompiledKernel.run
    function: int  # the CUfunction handle
    metadata: Any  # CompiledKernel.packed_metadata
    stream: Callable[[int], int]  # device index -> the current raw CUDA stream (the JIT's own getter)
    device: int
    runtime: Any  # triton.knobs.runtime (its launch hooks)


def _idle(enter: Any, exit: Any) -> bool:
    """True for no launch hooks: None (Triton 3.6) or an empty ``HookChain`` (Triton 3.9)."""
    return not getattr(enter, "calls", enter) and not getattr(exit, "calls", exit)


def _direct(compiled: Any) -> _Direct | None:
    """The direct launch of the kernel the JIT returned, or None (the interpreter, another Triton)."""
    if compiled is None or not hasattr(compiled, "packed_metadata"):  # the interpreter returns no kernel
        return None
    try:
        from triton import knobs
        from triton.runtime import driver

        active = driver.active
        direct = _Direct(compiled.run, compiled.function, compiled.packed_metadata, active.get_current_stream,
                         int(active.get_current_device()), knobs.runtime)
    except (AttributeError, ImportError, TypeError, RuntimeError):
        return None
    return direct if callable(direct.launcher) and isinstance(direct.function, int) else None


class Launch:
    """One Triton kernel launched over and over with one grid, one set of options and one specialisation.

    Args:
        fn: the ``@triton.jit`` kernel.
        grid: programs along each axis (one to three).
        options: launch options (``num_warps``, ...); shared, never modified.
        views: ``(position, dtype)``: arguments the JIT gets as ``arg.view(dtype)`` (a packed uint8
            tensor addressed as int32 words). The direct launch passes the tensor itself: only its
            address reaches the kernel, and the compiled kernel already has the view's type.

    The caller guarantees that every call's arguments specialise as the first call's did and
    that its tensors sit at the same positions, on the device of the first launch (the layout
    caches of ``kernels`` key on all of it). Arguments are positional, constexprs included, in
    the kernel's order (the JIT's and the compiled launcher's calling convention).
    """

    __slots__ = ("_direct", "_fn", "_grid", "_options", "_pointers", "_tried", "_views")

    def __init__(self, fn: Any, grid: tuple[int, ...], options: dict[str, Any],
                 views: tuple[tuple[int, torch.dtype], ...] = ()) -> None:
        if not 1 <= len(grid) <= 3:
            raise ValueError(f"a grid has one to three axes, got {grid}")
        self._fn, self._options, self._views = fn, options, views
        self._grid = (*grid, *(1,) * (3 - len(grid)))
        self._direct: _Direct | None = None
        self._pointers: tuple[int, ...] = ()  # positions of the tensor arguments
        self._tried = False

    @property
    def direct(self) -> bool:
        """True once launches skip the JIT (after the first launch of a compiled kernel)."""
        return self._direct is not None

    def __call__(self, *args: Any) -> None:
        d = self._direct
        if d is not None and _idle(d.runtime.launch_enter_hook, d.runtime.launch_exit_hook):
            # Addresses as integers: the launcher then skips its per-pointer driver query
            # (cuPointerGetAttribute), about a microsecond each; the layout key already
            # guarantees that every tensor is on the launch's device.
            call = list(args)
            for i in self._pointers:
                call[i] = call[i].data_ptr()
            g0, g1, g2 = self._grid
            d.launcher(g0, g1, g2, d.stream(d.device), d.function, d.metadata, None, None, None, *call)
            return
        call = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        for i, dtype in self._views:
            call[i] = call[i].view(dtype)
        compiled = self._fn[self._grid](*call, **self._options)
        if not self._tried:
            self._tried = True
            self._pointers = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
            self._direct = _direct(compiled)


class Scratch:
    """Small float32 buffers the launchers write and read within one call (partial extrema, decode tables).

    One buffer per (purpose, device, current stream, thread, size), kept: allocating one per call
    costs more host time than the launch. Calls on one stream are ordered, and calls of one thread
    never interleave their launches, so a kept buffer is never in use by two calls at once. While
    the stream is being captured into a CUDA graph the buffer is a fresh allocation, which the
    graph's memory pool keeps for its replays (they may run on another stream).
    """

    MAX_KEPT = 256  # distinct keys before the kept buffers are dropped (freed stream-ordered: safe)

    def __init__(self) -> None:
        self._kept: dict[Hashable, torch.Tensor] = {}
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._stream: Callable[[int], int] = raw_stream if raw_stream is not None else (
            lambda index: torch.cuda.current_stream(index).cuda_stream)

    def get(self, purpose: str, device: torch.device, index: int, numel: int) -> torch.Tensor:
        """A float32 buffer of ``numel`` elements on ``device`` (``index``: its CUDA index, -1 on CPU)."""
        if index < 0 or torch.cuda.is_current_stream_capturing():
            return torch.empty(numel, dtype=torch.float32, device=device)
        key = (purpose, index, self._stream(index), threading.get_ident(), numel)
        buf = self._kept.get(key)
        if buf is None:
            if len(self._kept) >= self.MAX_KEPT:
                self._kept.clear()
            buf = self._kept[key] = torch.empty(numel, dtype=torch.float32, device=device)
        return buf


class Layouts:
    """A bounded cache of the launchers' per-layout plans (``key -> plan``)."""

    MAX = 1024

    def __init__(self) -> None:
        self._plans: dict[Hashable, Any] = {}

    def get(self, key: Hashable) -> Any:
        return self._plans.get(key)

    def put(self, key: Hashable, plan: Any) -> Any:
        if len(self._plans) >= self.MAX:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def clear(self) -> None:
        self._plans.clear()
