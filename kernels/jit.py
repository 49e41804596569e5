"""Shared Numba settings for the kernels."""

import hashlib
from pathlib import Path

from numba import njit
from numba.core import caching
from numba.typed import List

PACKAGE_DIR = Path(__file__).resolve().parent

# Fused multiply-add allowed, reordering not: the model's sums keep their fixed order.
EXACT_MATH = {"contract"}

# Reductions may be reordered (so LLVM can vectorise float32 sums) and multiply-adds fused;
# no `nnan`/`ninf`, so NaN and Inf still propagate. Only for sums whose order cannot change a
# result (quantization's error search).
REDUCE_MATH = {"reassoc", "contract"}


def _numba(name: str):
    """A class of numba.core.caching by its name (older Numba spells them with a leading _)."""
    return getattr(caching, name, None) or getattr(caching, "_" + name)


def _package_stamp() -> str:
    h = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


class PackageCacheLocator(_numba("CacheLocator")):
    """Numba's on-disk cache stamped with every source file of this package, not only the
    kernel's own: kernels inline intrinsics and helpers from the other files, and Numba checks
    only the file that defines the kernel. A change to integer_products.py alone left decode_batch's
    old machine code in __pycache__ in use (a decode step of 8 at 14.6 ms against 12.5 ms
    compiled afresh). The cache stays where Numba would put it (NUMBA_CACHE_DIR, __pycache__,
    or the user-wide directory)."""

    STAMP = _package_stamp()
    PLACES = tuple(_numba(name) for name in ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator"))

    def __init__(self, place):
        self._place = place

    def __getattr__(self, name):  # the rest (Numba's messages read _py_file) from the wrapped locator
        return getattr(self._place, name)

    def ensure_cache_path(self):
        self._place.ensure_cache_path()

    def get_cache_path(self):
        return self._place.get_cache_path()

    def get_source_stamp(self):
        return self.STAMP

    def get_disambiguator(self):
        return self._place.get_disambiguator()

    @classmethod
    def from_function(cls, py_func, py_file):
        if Path(py_file).resolve().parent != PACKAGE_DIR:
            return None
        for place in cls.PLACES:
            found = place.from_function(py_func, py_file)
            if found is not None:
                return cls(found)
        return None


# Consulted when a kernel is defined (njit(cache=True) looks for its cache then): this module is
# imported before any kernel module.
_LOCATORS = _numba("CacheImpl")._locator_classes
if PackageCacheLocator not in _LOCATORS:
    _LOCATORS.insert(0, PackageCacheLocator)


# Everything the forward pass's threads run compiles without Numba's reference counting
# (`_nrt=False`, `refcounts=False` here): each array view otherwise increments and decrements its
# parent's count atomically, and with two threads on the same arrays those atomics moved one cache
# line between the cores on every task and row. They were a quarter of an int8 decode step
# (perf: lock incq / lock decq), whose speed fell to 0.73 of the tree before the one forward pass
# at 2 threads (0.93 at one); without them 0.94 and float32 1.01. None of those kernels allocates.


def kernel(parallel: bool = True, fastmath=False, refcounts: bool = True):
    """`@njit` with on-disk caching: compiled once per machine, loaded in milliseconds after.
    refcounts=False: without reference counting, for kernels the threads run (above)."""
    return njit(parallel=parallel, cache=True, fastmath=fastmath, nogil=True, _nrt=refcounts)


def array_key(a) -> tuple:
    """What decides an array's Numba type (dtype, dimensions, layout, writability, alignment)."""
    f = a.flags
    return a.dtype.str, a.ndim, f.c_contiguous, f.f_contiguous, f.writeable, f.aligned


class DirectCall:
    """A kernel called without its dispatcher's per-call type resolution.

    Numba's dispatcher resolves the types of NamedTuple and typed-List arguments in Python on
    every call: for the decode step's two NamedTuples of ~50 arrays that is ~0.3 ms, 5% of a
    4-bit decode step of the default model. The compiled entry point takes the same arguments
    and unboxes them in ~10 us. The caller names what can change the arguments' types (`key`);
    the first call with a new key goes through the dispatcher (compiling or loading the kernel)
    and keeps the entry point it chose."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        self._entries = {}

    def __call__(self, key, *args):
        entry = self._entries.get(key)
        if entry is not None:
            return entry(*args)
        result = self.dispatcher(*args)
        signature = tuple(self.dispatcher.typeof_pyval(a) for a in args)
        self._entries[key] = self.dispatcher.overloads[signature].entry_point
        return result


@njit(cache=True)
def _list_of(first):
    items = List()
    items.append(first)
    return items


@njit(cache=True)
def _append(items, item):
    items.append(item)


def typed_list(arrays) -> List:
    """A numba.typed.List of arrays of one type, built by cached compiled code.

    List() and .append called from Python compile Numba's list helpers in every new process:
    ~0.3 s of start-up and ~7 MB of a GGUF run's peak memory (issue 19's bar 5). Compiled here
    once per machine."""
    arrays = list(arrays)
    items = _list_of(arrays[0])
    for a in arrays[1:]:
        _append(items, a)
    return items


# Optional modules Numba imports when it first loads a kernel, for features these kernels never
# use: SciPy's BLAS (np.dot and np.linalg in jitted code) and cffi (calling cffi functions).
NUMBA_EXTRAS_UNUSED = ("scipy.linalg", "cffi")


def load_numba_registries(without: tuple[str, ...] = NUMBA_EXTRAS_UNUSED) -> None:
    """Load Numba's typing and lowering registries now, with the modules `without` hidden.

    For a process that owns its imports (cli.py): SciPy's part is ~20 MB of peak memory and
    ~0.2 s. The price: jitted code in this process cannot use np.dot or np.linalg, which
    minillm's kernels never call. The modules stay importable afterwards; a module already
    imported is not hidden; nothing happens once the registries are loaded."""
    import sys

    from numba.core.registry import cpu_target

    if "numba.np.arraymath" in sys.modules:  # the registries are loaded already
        return
    hidden = [name for name in without if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # `import name` raises ImportError, which Numba treats as absent
    try:
        cpu_target.target_context.refresh()
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


# ---------------------------------------------------------------- kernels called by address


def address_call(signature, name: str):
    """An intrinsic `name(address, *args)` that calls the compiled C function at `address` (a
    kernels.formats kernel, a numba cfunc of `signature`) with args of exactly those types.

    The callee is not linked into the caller: the caller compiles once for every format, and a
    format's code is compiled (and optimised by LLVM) once, in its own module, only when a model
    needs it. An indirect call costs ~30 ns, so callers make one per matrix and thread, not per row."""
    from llvmlite import ir
    from numba.core import types as nbtypes
    from numba.extending import intrinsic

    n = len(signature.args)

    def typer(typingctx, address, *args):
        if len(args) == 1 and isinstance(args[0], nbtypes.StarArgTuple):
            args = tuple(args[0].types)
        if len(args) != n or any(a != b for a, b in zip(args, signature.args)) or not isinstance(address, nbtypes.Integer):
            return None
        sig = signature.return_type(address, nbtypes.StarArgTuple(args))

        def codegen(context, builder, sig, llargs):
            values = [builder.extract_value(llargs[1], i) for i in range(n)]
            ret = context.get_value_type(signature.return_type) if signature.return_type != nbtypes.void else ir.VoidType()
            fnty = ir.FunctionType(ret, [context.get_value_type(t) for t in signature.args])
            result = builder.call(builder.inttoptr(llargs[0], fnty.as_pointer()), values)
            return context.get_dummy_value() if signature.return_type == nbtypes.void else result

        return sig, codegen

    typer.__name__ = name
    return intrinsic(typer)


def _call_at():
    from numba.core import types as nbtypes
    from numba.extending import intrinsic

    @intrinsic
    def call_at(typingctx, address, *args):
        """Call the compiled Numba function at `address` (native_address) with args, returning
        nothing: a function compiled for exactly these argument types. Numba's own calling
        convention, so any argument type passes (tuples of arrays and typed lists, which C
        callbacks refuse)."""
        if len(args) == 1 and isinstance(args[0], nbtypes.StarArgTuple):
            args = tuple(args[0].types)
        if not isinstance(address, nbtypes.Integer):
            return None
        sig = nbtypes.void(address, nbtypes.StarArgTuple(args))

        def codegen(context, builder, sig, llargs):
            values = [builder.extract_value(llargs[1], i) for i in range(len(args))]
            fnty = context.call_conv.get_function_type(nbtypes.none, args)
            callee = builder.inttoptr(llargs[0], fnty.as_pointer())
            context.call_conv.call_function(builder, callee, nbtypes.none, args, values)  # our kernels raise nothing
            return context.get_dummy_value()

        return sig, codegen

    return call_at


call_at = _call_at()


def native_address(dispatcher, signature) -> int:
    """The address of a Numba function compiled for `signature`, as call_at calls it."""
    cres = dispatcher.overloads[tuple(signature.args)]
    return cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)


# ---------------------------------------------------------------- saying that kernels compile


class CompileNotice:
    """One line on stderr while kernels compile (the first run on a machine or after an update):
    what compiles, for which CPU, and how far it is. Silent when everything loads from Numba's
    cache, which takes milliseconds.

        with CompileNotice("kernels for Q4_K and Q6_K", jobs=5) as notice:
            for job in jobs:
                build(job); notice.step()
    """

    _active = 0  # nested notices: only the outermost speaks

    def __init__(self, what: str, jobs: int, stream=None):
        import sys

        self.what, self.jobs, self.done = what, jobs, 0
        self.stream = stream if stream is not None else sys.stderr
        self.started = None  # when the first compile began
        self._listener = None

    def __enter__(self):
        from numba.core import event

        CompileNotice._active += 1
        if CompileNotice._active == 1 and not _quiet():
            notice = self

            class Listener(event.Listener):
                def on_start(self, ev):
                    notice._compiling()

                def on_end(self, ev):
                    pass

            self._listener = Listener()
            event.register("numba:compile", self._listener)
        return self

    def _compiling(self) -> None:
        import time

        if self.started is None:
            from .target import describe

            self.started = time.perf_counter()
            self._write(f"compiling {self.what} for this CPU ({describe()}), first run only ...")

    def step(self) -> None:
        self.done += 1
        if self.started is not None and self._tty():
            self._write(f"compiling {self.what} for this CPU, first run only: {self.done}/{self.jobs}", end="")

    def __exit__(self, *exc):
        import time

        from numba.core import event

        CompileNotice._active -= 1
        if self._listener is not None:
            event.unregister("numba:compile", self._listener)
        if self.started is not None:
            self._write(f"compiled {self.what} in {time.perf_counter() - self.started:.0f} s; later runs load them from the cache")
        return False

    def _tty(self) -> bool:
        return hasattr(self.stream, "isatty") and self.stream.isatty()

    def _write(self, text: str, end: str = "\n") -> None:
        if self._tty():
            self.stream.write("\r\033[K" + text + end)
        else:
            if end:  # progress lines only on a terminal
                self.stream.write(text + end)
        self.stream.flush()


def _quiet() -> bool:
    import os

    return os.environ.get("MINILLM_QUIET_COMPILE", "") not in ("", "0")


# ---------------------------------------------------------------- array views without checks
#
# reshape and view compile their error paths (string formatting) into every caller: ~3 s of a
# first run's compile. These make the same views of C-contiguous data the callers already
# sized, with no checks.


def _view_intrinsics():
    from numba.core import types as nbtypes
    from numba.core.imputils import impl_ret_borrowed
    from numba.extending import intrinsic

    def make(context, builder, arrty, arr, ret, dtype, shape):
        src = context.make_array(arrty)(context, builder, arr)
        out = context.make_array(ret)(context, builder)
        item = context.get_abi_sizeof(context.get_data_type(dtype))
        intp = context.get_value_type(nbtypes.intp)
        shape = [builder.sext(s, intp) if s.type.width < intp.width else s for s in shape]
        strides = [builder.mul(shape[1], intp(item)), intp(item)]
        data = builder.bitcast(src.data, context.get_data_type(dtype).as_pointer())
        context.populate_array(out, data=data, shape=shape, strides=strides, itemsize=intp(item), meminfo=src.meminfo, parent=None)
        return impl_ret_borrowed(context, builder, ret, out._getvalue())

    @intrinsic
    def rows_view(typingctx, flat, rows, width):
        """flat[:rows * width] as a (rows, width) C array of flat's dtype (flat: 1-D C)."""
        if not isinstance(flat, nbtypes.Array) or flat.ndim != 1 or flat.layout != "C":
            return None
        ret = nbtypes.Array(flat.dtype, 2, "C")

        def codegen(context, builder, sig, args):
            return make(context, builder, sig.args[0], args[0], ret, flat.dtype, [args[1], args[2]])

        return ret(flat, rows, width), codegen

    @intrinsic
    def reinterpret(typingctx, arr, dtype):
        """A 2-D C array's rows as elements of `dtype` (a NumPy scalar type): (N, bytes // size)."""
        if not isinstance(arr, nbtypes.Array) or arr.ndim != 2 or arr.layout != "C" or not isinstance(dtype, nbtypes.NumberClass):
            return None
        to = dtype.instance_type
        ret = nbtypes.Array(to, 2, "C")

        def codegen(context, builder, sig, args):
            src = context.make_array(sig.args[0])(context, builder, args[0])
            rows, width = cgutils_unpack(builder, src.shape, 2)
            old = context.get_abi_sizeof(context.get_data_type(arr.dtype))
            new = context.get_abi_sizeof(context.get_data_type(to))
            width = builder.udiv(builder.mul(width, width.type(old)), width.type(new))
            return make(context, builder, sig.args[0], args[0], ret, to, [rows, width])

        return ret(arr, dtype), codegen

    @intrinsic
    def array_at(typingctx, table, i, dtype):
        """The (rows, width) C array of `dtype` described by row i of `table` (int64 (n, 3): data
        address, rows, width): memory a Python object owns and keeps alive (no reference is
        counted, so code compiled without reference counting may make it)."""
        if not isinstance(dtype, nbtypes.NumberClass) or not isinstance(table, nbtypes.Array) or table.ndim != 2:
            return None
        to = dtype.instance_type
        ret = nbtypes.Array(to, 2, "C")

        def codegen(context, builder, sig, args):
            tab = context.make_array(sig.args[0])(context, builder, args[0])
            row = builder.gep(tab.data, [builder.mul(args[1], context.get_constant(nbtypes.intp, 3))])
            address, rows, width = (builder.load(builder.gep(row, [context.get_constant(nbtypes.intp, k)])) for k in range(3))
            out = context.make_array(ret)(context, builder)
            item = context.get_abi_sizeof(context.get_data_type(to))
            intp = context.get_value_type(nbtypes.intp)
            data = builder.inttoptr(address, context.get_data_type(to).as_pointer())
            context.populate_array(out, data=data, shape=[rows, width], strides=[builder.mul(width, intp(item)), intp(item)],
                                   itemsize=intp(item), meminfo=None, parent=None)
            return out._getvalue()

        return ret(table, i, dtype), codegen

    def cgutils_unpack(builder, tup, n):
        from numba.core import cgutils

        return cgutils.unpack_tuple(builder, tup, n)

    return rows_view, reinterpret, array_at


rows_view, reinterpret, array_at = _view_intrinsics()
