"""Kernel launches, and plans that replay a call's launches without Triton's per-call work.

Every launcher in ``kernels/`` starts its kernels through :func:`run`. Outside a recording that is
``kernel[grid](*args, **kwargs)``: Triton binds the ~40 arguments, works out their specialization
(alignment, divisibility, int32 or int64), looks the compiled kernel up, builds the TMA descriptors
and launches. At short sequences that host work takes longer than the kernel itself.

A *plan* removes it for calls that repeat. The public functions key each call on everything the
validation and the launchers' choices read: every tensor's shape, strides, dtype, device and pointer
alignment, and the scalar arguments. The call after the first one of a key runs under a
:class:`_Recorder` (a ``TorchDispatchMode``), which notes

* each allocation (size, strides, dtype, and the fill of ``zeros`` / ``fill_`` / ``zero_``),
* each launch through :func:`run`: the compiled kernel, the grid, and every argument, where a
  tensor (or a TMA descriptor's base) becomes "root r plus this many bytes": the root is one of the
  call's input tensors or one of its allocations,
* which roots the call returned.

Replaying a plan allocates the same buffers, fills a copy of each launch's argument list with the
new pointers (and cached TMA descriptors) and calls Triton's compiled launcher directly. Anything a
recording cannot replay exactly marks the key as not replayable and it keeps the normal path: a
torch operation other than allocations, views and whole-buffer fills (a copy, a host read of a
value), a pointer that matches no root or several, a kernel with launch hooks or scratch memory.
Everything else the launchers decide (kernel, variant, config, grid, descriptors, int64 offsets)
is a function of the key, so the replay launches exactly what the normal path would.

Under ``TRITON_INTERPRET=1`` a replay rebuilds each argument as a view of its root and launches
through Triton's interpreter: the CPU tests exercise the same recording and mapping.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from triton import knobs as _knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from . import configs

# Plans are recorded and replayed while this is True (tests that replace launchers switch it off).
ENABLED = True
# A key's plan is recorded at its RECORD_AT-th call (2: a shape seen once never pays for a recording).
RECORD_AT = 2
# At most this many keys per cache; a full cache is emptied (a model has a handful of call shapes).
MAX_KEYS = 4096

# Why the last recording that failed could not be replayed (for tests and debugging).
LAST_FAILURE: str | None = None

class _Local(threading.local):
    recorder = None                 # the recording in progress on this thread, if any


_local = _Local()
_CACHES: list[dict] = []


def plans():
    """Every recorded plan (for tests)."""
    for table in _CACHES:
        for entry in list(table.values()):
            for e in [entry, *(entry.sub or {}).values()]:
                if e.plan:
                    yield e.plan


def clear_plans() -> None:
    """Forget every validated call shape and recorded plan (needed only after changing
    triflash's internal choosers or configs at run time)."""
    for cache in _CACHES:
        cache.clear()


def cache() -> dict:
    """A new key -> :class:`Entry` dict, emptied by :func:`clear_plans`."""
    d: dict = {}
    _CACHES.append(d)
    return d


class Entry:
    """One call shape: what validation resolved (``info``), calls seen, and its plan (None until
    recorded, False when not replayable). ``sub`` holds dependent shapes (a forward's backwards).
    ``keyed``: the entry belongs to a key (its tensors are plain ones with storage); an unkeyed
    entry lives for one call."""

    __slots__ = ("info", "plan", "calls", "sub", "keyed")

    def __init__(self, info=None, keyed=False):
        self.info, self.plan, self.calls, self.sub, self.keyed = info, None, 0, None, keyed


def lookup(table: dict, key, validate, *args):
    """The Entry of ``key`` in ``table``; a new key is first validated (``validate(*args)``, which
    raises on bad input and returns the Entry's ``info``). A key that is None or cannot be hashed
    (a list where a tuple is usual) is validated every time and never gets a plan."""
    if key is not None:
        try:
            entry = table.get(key)
        except TypeError:
            key = None
    if key is None:
        entry = Entry(validate(*args))
        entry.plan = False
        return entry
    if entry is None:
        entry = Entry(validate(*args), keyed=True)
        if len(table) >= MAX_KEYS:
            table.clear()
        table[key] = entry
    return entry


def meta(t: torch.Tensor) -> tuple:
    """What validation and the launchers read of a tensor, for call keys: shape, strides, dtype,
    device, and the pointer's alignment (Triton specializes pointers on 16-byte alignment; TMA
    needs it). Only plain tensors have keys (subclasses, fake tensors: TypeError; non-tensors:
    AttributeError; functorch wrappers without storage: RuntimeError), so those are validated on
    every call and never replayed."""
    if t.__class__ is not torch.Tensor:
        raise TypeError("not a plain tensor")
    return (t.shape, t.stride(), t.dtype, t.get_device() if t.is_cuda else t.device.type, t.data_ptr() & 15)


def call(entry: Entry | None, fn, inputs: tuple, *args):
    """``fn(*inputs, *args)``, through ``entry``'s plan once it has one. ``inputs`` are the call's
    tensors (None allowed), ``args`` everything else; both must be determined by the entry's key."""
    if entry is None or not ENABLED or _local.recorder is not None:
        return fn(*inputs, *args)
    plan = entry.plan
    if plan:
        if _hooks_free():
            results = plan.replay(inputs)
            if results is not None:
                return results
        return fn(*inputs, *args)
    if plan is None:
        entry.calls += 1
        if entry.calls >= RECORD_AT:
            results, entry.plan = record(fn, inputs, args)
            return results
    return fn(*inputs, *args)


def run(kernel, grid, *args, **kwargs):
    """Launch ``kernel`` over ``grid``: ``kernel[grid](*args, **kwargs)``, noted by the recorder
    when a plan is being recorded."""
    recorder = _local.recorder
    if recorder is None:
        return kernel[grid](*args, **kwargs)
    with _disable_current_modes():
        compiled = kernel[grid](*args, **kwargs)
    recorder.launch(kernel, grid, args, kwargs, compiled)
    return compiled


def _hooks_free() -> bool:
    """No Triton launch hook is set (a profiler such as proton sets them; a replay does not call
    them, so it is not used then)."""
    rt = _knobs.runtime
    return _empty_hook(rt.launch_enter_hook) and _empty_hook(rt.launch_exit_hook)


def _empty_hook(hook) -> bool:
    return hook is None or (type(hook).__name__ == "HookChain" and not hook.calls)


# -- recording --------------------------------------------------------------------------------------

class NotReplayable(Exception):
    """A recording saw something a replay could not redo."""


def record(fn, inputs: tuple, args: tuple):
    """Run ``fn(*inputs, *args)`` once, recording it. Returns (its results, a Plan or False)."""
    recorder = _Recorder(inputs)
    _local.recorder = recorder
    try:
        with recorder:
            results = fn(*inputs, *args)
    finally:
        _local.recorder = None
    try:
        plan = recorder.plan(results)
    except NotReplayable as exc:
        global LAST_FAILURE
        LAST_FAILURE = str(exc)
        plan = False
    return results, plan


def _span(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to the end of its last."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


_VIEW_CACHE: dict = {}


def _is_view(func) -> bool:
    """Whether an aten op returns views of its inputs without writing anything."""
    answer = _VIEW_CACHE.get(func)
    if answer is None:
        schema = func._schema
        answer = (bool(schema.returns)
                  and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
                  and not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments))
        _VIEW_CACHE[func] = answer
    return answer


_aten = torch.ops.aten
# Allocating ops, with the value they fill with (None: uninitialised).
_ALLOCS = {
    _aten.empty.memory_format: None, _aten.empty_strided.default: None, _aten.empty_like.default: None,
    _aten.new_empty.default: None, _aten.new_empty_strided.default: None,
    _aten.zeros.default: 0, _aten.zeros_like.default: 0, _aten.new_zeros.default: 0,
}
_FULLS = {_aten.full.default: 1, _aten.full_like.default: 1, _aten.new_full.default: 2}
_FILLS = {_aten.fill_.Scalar: 1, _aten.zero_.default: None}


@dataclasses.dataclass
class _Alloc:
    size: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    contiguous: bool


class _Recorder(TorchDispatchMode):
    """Notes a call's allocations, fills and launches (see the module docstring)."""

    def __init__(self, inputs: tuple):
        super().__init__()
        self.roots: list = list(inputs)         # input tensors (or None), then allocations
        self.n_inputs = len(inputs)
        self.allocs: list[_Alloc] = []
        self.steps: list = []                   # ("fill", root, value) or _Launch
        self.failure: str | None = None
        self.same: set = set()                  # (root, root) pairs that must share a pointer
        devices = {t.device for t in inputs if isinstance(t, torch.Tensor)}
        self.device = devices.pop() if len(devices) == 1 else None
        if self.device is None:
            self.failure = "inputs on several devices"

    def fail(self, why: str):
        if self.failure is None:
            self.failure = why

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.failure is not None:
            return out
        if func in _ALLOCS or func in _FULLS:
            fill = _ALLOCS[func] if func in _ALLOCS else (
                kwargs["fill_value"] if "fill_value" in kwargs else args[_FULLS[func]])
            self._alloc(out, fill)
        elif func in _FILLS:
            value = 0 if _FILLS[func] is None else args[1]
            self.steps.append(("fill", self._whole_alloc(args[0]), value))
        elif _is_view(func):
            pass
        elif self.device is not None and self.device.type == "cuda" and not _touches(self.device, args,
                                                                                     kwargs, out):
            pass                                # host arithmetic on CPU tensors (a chooser's model)
        else:
            self.fail(f"torch operation {func}")
        return out

    def _alloc(self, t, fill):
        if not isinstance(t, torch.Tensor) or t.device != self.device:
            self.fail("an allocation on another device")
            return
        self.roots.append(t)
        self.allocs.append(_Alloc(tuple(t.shape), tuple(t.stride()), t.dtype, t.device,
                                  t.is_contiguous()))
        if fill is not None:
            self.steps.append(("fill", len(self.roots) - 1, fill))

    def _whole_alloc(self, t) -> int:
        """The allocation ``t`` covers whole (a fill of anything else is not replayed)."""
        for i in range(self.n_inputs, len(self.roots)):
            r = self.roots[i]
            if r.data_ptr() == t.data_ptr() and r.numel() == t.numel() and _span(r) == _span(t):
                return i
        self.fail("a fill of part of a buffer, or of an input")
        return -1

    # -- launches --

    def _locate(self, t: torch.Tensor) -> tuple[int, int]:
        """(root, byte offset) of a tensor argument: the root it starts at, else the one root that
        holds it."""
        ptr = t.data_ptr()
        if ptr == 0:
            return -1, 0                        # no elements: passed as a null pointer
        end = ptr + _span(t)
        exact = [i for i, r in enumerate(self.roots)
                 if r is not None and r.data_ptr() == ptr and end <= ptr + _span(r)]
        if exact:
            # One tensor passed as two inputs (cu_seqlens_q is cu_seqlens_k, say): the plan holds
            # for calls where those inputs alias again (checked at replay).
            for other in exact[1:]:
                self.same.add((exact[0], other))
            return exact[0], 0
        holders = [i for i, r in enumerate(self.roots) if r is not None and r.numel()
                   and r.data_ptr() <= ptr and end <= r.data_ptr() + _span(r)]
        if len(holders) != 1:
            raise NotReplayable("a pointer that matches no root or several")
        return holders[0], ptr - self.roots[holders[0]].data_ptr()

    def launch(self, kernel, grid, args, kwargs, compiled):
        if self.failure is not None:
            return
        try:
            self.steps.append(_Launch.record(self, kernel, grid, args, kwargs, compiled))
        except NotReplayable as exc:
            self.fail(str(exc))

    def plan(self, results) -> Plan:
        if self.failure is not None:
            raise NotReplayable(self.failure)
        if not isinstance(results, tuple):
            raise NotReplayable("results that are not a tuple")
        outs = []
        for r in results:
            if r is None:
                outs.append(None)
                continue
            if not isinstance(r, torch.Tensor):
                raise NotReplayable("a result that is not a tensor")
            idx = next((i for i in range(self.n_inputs, len(self.roots)) if self.roots[i] is r), None)
            if idx is None and r.numel() == 0:
                # An empty result (a gradient not asked for): an empty allocation of its kind.
                taken = {o[0] for o in outs if o is not None}
                idx = next((i for i in range(self.n_inputs, len(self.roots))
                            if i not in taken and self.roots[i].numel() == 0
                            and self.roots[i].shape == r.shape and self.roots[i].dtype == r.dtype
                            and self.roots[i].stride() == r.stride()), None)
                if idx is None:
                    raise NotReplayable("an empty result that is not an allocation")
            if idx is not None:
                outs.append((idx, None))
                continue
            root, offset = self._locate(r)
            if root < self.n_inputs or offset % r.element_size() or r.dtype != self.roots[root].dtype:
                raise NotReplayable("a result that is not a view of an allocation")
            base = self.roots[root]
            view = (tuple(r.shape), tuple(r.stride()), base.storage_offset() + offset // r.element_size())
            # The allocation itself (the mode hands back another Python object for the same tensor)
            # is returned as it is: no view to make per call.
            same = view == (tuple(base.shape), tuple(base.stride()), base.storage_offset())
            outs.append((root, None if same else view))
        return Plan(self.n_inputs, self.allocs, self.steps, outs, self.device, sorted(self.same))


def _touches(device, args, kwargs, out) -> bool:
    """Whether any tensor among an op's arguments or results is on ``device``."""
    found = False

    def visit(x):
        nonlocal found
        if isinstance(x, torch.Tensor):
            found = found or x.device == device
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
    visit(args)
    visit(list(kwargs.values()))
    visit(out)
    return found


# -- one recorded launch --------------------------------------------------------------------------

def _raw_launcher(compiled):
    """(Triton's C launch function, whether the CudaLauncher wraps tensor descriptors), or None
    where this Triton's launcher is not the one this module knows (then the key is not replayed)."""
    try:
        launcher = compiled.run                  # CudaLauncher, made on first use
        fn = launcher.launch
        if launcher.global_scratch_size or launcher.profile_scratch_size:
            return None
    except AttributeError:
        return None
    closure = getattr(fn, "__closure__", None)
    if closure:
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in closure)))
        inner = cells.get("launcher")
        if inner is None or "tensordesc_indices" not in cells:
            return None
        return inner, launcher
    return fn, launcher


class _Launch:
    """A recorded launch. ``template``: Triton's C launcher's whole argument list with every value
    known at recording; ``ptrs``: (position, root, byte offset) to fill from the call's tensors;
    ``tmaps``: (position, root, offset, encode arguments, cache) for TMA descriptors encoded on
    the host, cached by address. Under the interpreter: ``params`` to rebuild the arguments."""

    @classmethod
    def record(cls, rec: _Recorder, kernel, grid, args, kwargs, compiled) -> _Launch:
        self = cls()
        if callable(grid) or not hasattr(kernel, "fn") or getattr(kernel, "pre_run_hooks", None):
            raise NotReplayable("a launch this module cannot replay")
        grid = tuple(grid) + (1,) * (3 - len(grid))
        params = inspect.signature(kernel.fn).parameters
        names = list(params)
        bound = dict(zip(names, args))
        for name, value in kwargs.items():
            if name in params:
                bound[name] = value
        values = []
        for name, p in params.items():
            if name in bound:
                values.append(bound[name])
            elif p.default is not p.empty:
                values.append(p.default)
            else:
                raise NotReplayable(f"argument {name} missing")
        self.grid = grid
        self.kernel = kernel
        self.kwargs = {k: v for k, v in kwargs.items() if k not in names}
        self.params = []                          # for the interpreter: (kind, data)
        for value in values:
            if isinstance(value, torch.Tensor):
                root, off = rec._locate(value)
                self.params.append(("tensor", (root, off, tuple(value.shape), tuple(value.stride()),
                                               value.dtype)))
            elif _is_descriptor(value):
                root, off = rec._locate(value.base)
                base = value.base
                desc = copy.copy(value)
                desc.base = None                  # the plan keeps no tensor of the recorded call alive
                self.params.append(("desc", (root, off, tuple(base.shape), tuple(base.stride()),
                                             base.dtype, desc)))
            else:
                self.params.append(("value", value))
        if configs.INTERPRET:
            self.raw = None
            return self
        found = _raw_launcher(compiled)
        if found is None:
            raise NotReplayable("a launcher this module does not know")
        self.raw, launcher = found
        metas = list(getattr(compiled.metadata, "tensordesc_meta", None) or [])
        n_desc = sum(kind == "desc" for kind, _ in self.params)
        if metas and len(metas) != n_desc:
            raise NotReplayable("descriptor metadata that does not match the arguments")
        wrapped = self.raw is not launcher.launch
        if n_desc and not wrapped:
            raise NotReplayable("descriptors without Triton's descriptor wrapper")
        compiled_fn = compiled.function
        template = [grid[0], grid[1], grid[2], 0, compiled_fn, launcher.launch_cooperative_grid,
                    launcher.launch_pdl, None, None, compiled.packed_metadata, None, None, None]
        ptrs, tmaps, d = [], [], 0
        for kind, data in self.params:
            if kind == "tensor":
                root, off = data[0], data[1]
                if root >= 0:
                    ptrs.append((len(template), root, off))
                template.append(0)
            elif kind == "desc":
                root, off, _, _, _, desc = data
                meta = metas[d] if metas else None
                d += 1
                shape, strides = list(desc.shape), list(desc.strides)
                if meta is None:
                    ptrs.append((len(template), root, off))
                    template += [0, *shape, *strides, desc.padding == "nan", *shape, *strides]
                else:
                    if meta["fp4_padded"]:
                        raise NotReplayable("an fp4-padded descriptor")
                    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
                    encode = (meta["swizzle"], meta["elem_size"],
                              TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["block_size"],
                              shape, strides, 1 if desc.padding == "nan" else 0)
                    tmaps.append((len(template), root, off, encode, {}))
                    template += [None, *shape, *strides]
            else:
                template.append(data)
        self.template, self.ptrs, self.tmaps = template, ptrs, tmaps
        import triton

        self.fill_tma = triton.runtime.driver.active.utils.fill_tma_descriptor
        return self

    def replay(self, ptrs: list, stream: int, roots: list) -> None:
        if self.raw is None:
            self._interpret(roots)
            return
        args = self.template.copy()
        args[3] = stream
        for pos, root, off in self.ptrs:
            args[pos] = ptrs[root] + off
        for pos, root, off, encode, known in self.tmaps:
            address = ptrs[root] + off
            tmap = known.get(address)
            if tmap is None:
                if len(known) >= 64:
                    known.clear()
                tmap = known[address] = self.fill_tma(address, *encode)
            args[pos] = tmap
        self.raw(*args)

    def _interpret(self, roots: list) -> None:
        args = []
        for kind, data in self.params:
            if kind == "tensor":
                args.append(_view(roots, *data))
            elif kind == "desc":
                root, off, shape, stride, dtype, desc = data
                args.append(dataclasses.replace(desc, base=_view(roots, root, off, shape, stride, dtype)))
            else:
                args.append(data)
        self.kernel[self.grid](*args, **self.kwargs)


def _is_descriptor(value) -> bool:
    return hasattr(value, "base") and hasattr(value, "block_shape") and hasattr(value, "strides")


def _view(roots: list, root: int, off: int, shape, stride, dtype) -> torch.Tensor:
    """The tensor argument ``root`` + ``off`` bytes, rebuilt (interpreter replays)."""
    if root < 0:
        return torch.empty(shape, dtype=dtype)
    base = roots[root]
    start = base.storage_offset() * base.element_size() + off
    t = torch.empty(0, dtype=dtype, device=base.device)
    return t.set_(base.untyped_storage(), start // t.element_size(), shape, stride)


_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


# -- plans --------------------------------------------------------------------------------------------

class Plan:
    """A recorded call: allocations, fills and launches, replayed on new inputs of the same key."""

    def __init__(self, n_inputs, allocs, steps, outs, device, same=()):
        self.replays = 0                      # for tests: how often this plan ran
        self.n_inputs = n_inputs
        self.same = same
        self.allocs = [(a.size, a.stride, a.dtype, a.device, a.contiguous) for a in allocs]
        self.steps = steps
        self.outs = outs
        self.device_index = device.index if device.type == "cuda" else None

    def __bool__(self):
        return True

    def replay(self, inputs: tuple):
        """The call's results, or None where the inputs do not alias as they did when recorded."""
        index = self.device_index
        if index is not None and _current_device() != index:
            with torch.cuda.device(index):
                return self._replay(inputs)
        return self._replay(inputs)

    def _replay(self, inputs: tuple):
        ptrs = [0 if t is None else t.data_ptr() for t in inputs]
        for a, b in self.same:
            if ptrs[a] != ptrs[b]:
                return None
        self.replays += 1
        roots = list(inputs)
        for size, stride, dtype, device, contiguous in self.allocs:
            t = (torch.empty(size, dtype=dtype, device=device) if contiguous
                 else torch.empty_strided(size, stride, dtype=dtype, device=device))
            roots.append(t)
            ptrs.append(t.data_ptr())
        stream = (torch._C._cuda_getCurrentRawStream(self.device_index)
                  if self.device_index is not None else 0)
        for step in self.steps:
            if type(step) is tuple:
                roots[step[1]].fill_(step[2])
            else:
                step.replay(ptrs, stream, roots)
        return tuple(None if o is None else roots[o[0]] if o[1] is None
                     else torch.as_strided(roots[o[0]], *o[1]) for o in self.outs)


# ------------------------------------------------------------------------------------------------
# TMA: what it accepts, and host-built descriptors
# ------------------------------------------------------------------------------------------------

def host_descriptors(block_rows: int, block_d: int, *tensors: torch.Tensor) -> tuple[TensorDescriptor, ...]:
    """Host-built TMA descriptors of [B, S, H, D] tensors (which ``tma_compatible`` accepted), each
    moving [1, block_rows, 1, block_d] boxes: one (batch, head)'s block of rows. Built without
    TensorDescriptor's own re-validation: at short sequences the forward's host time per call is
    what a benchmark measures, and the four descriptors' checks were a fifth of it."""
    block_shape = [1, block_rows, 1, block_d]
    if not _PLAIN_DESCRIPTOR:
        return tuple(TensorDescriptor.from_tensor(t, block_shape) for t in tensors)
    descs = []
    for t in tensors:
        desc = object.__new__(TensorDescriptor)
        desc.base, desc.shape, desc.strides = t, t.shape, t.stride()
        desc.block_shape, desc.padding = block_shape, "zero"
        descs.append(desc)
    return tuple(descs)


# The shortcut above fills exactly these fields; a Triton whose descriptor has others takes the
# validating constructor.
_PLAIN_DESCRIPTOR = {f.name for f in dataclasses.fields(TensorDescriptor)} == {
    "base", "shape", "strides", "block_shape", "padding"}


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned base addresses, unit stride on head_dim and positive 16-byte aligned
    strides on every other dim. Contiguous tensors, transposed views and packed qkv pass whenever
    head_dim * element size is a multiple of 16 bytes. (Written as plain loops: it runs on every
    call, and at short sequences the host time per call is what a benchmark sees.)"""
    for t in tensors:
        if t.data_ptr() % 16:
            return False
        size = t.element_size()
        strides = t.stride()
        if strides[-1] != 1:
            return False
        for s in strides[:-1]:
            if s <= 0 or (s * size) % 16:
                return False
    return True
