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
    only the file that defines the kernel. A change to row_groups.py alone left decode_batch's
    old machine code in __pycache__ in use (a decode step of 8 at 14.6 ms against 12.5 ms
    compiled afresh). The cache stays where Numba would put it (NUMBA_CACHE_DIR, __pycache__,
    or the user-wide directory)."""

    STAMP = _package_stamp()
    PLACES = tuple(_numba(name) for name in ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator"))

    def __init__(self, place):
        self._place = place

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


def kernel(parallel: bool = True, fastmath=False):
    """`@njit` with on-disk caching: compiled once per machine, loaded in milliseconds after."""
    return njit(parallel=parallel, cache=True, fastmath=fastmath, nogil=True)


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
