"""`aot.jit`: jax.jit whose compiled programs outlive the process.

JAX's persistent compilation cache skips XLA's compile on a warm start, but each process still traces and lowers
every step it calls and hashes the lowered module to find the entry (Gemma 3 270M's prefill: 0.10 s tracing,
0.06 s lowering, then the cache read). `aot.jit` keeps the serialized executable itself (JAX's
`jax.experimental.serialize_executable`) in a store of two levels:

- a key file per call signature, `<function>-<environment>-<key>.key`, keyed on everything that decides the
  lowered program: the function (module and name), its static arguments, the pytree structure and the shape, dtype
  and weak type of every array argument, fucina_jax's own files (any change to them is a new environment), and
  JAX's options. It names
- the program, `<function>-<fingerprint>.bin`: the executable, keyed on the lowered module's text (no source
  locations) plus JAX's and jaxlib's versions, XLA_FLAGS, the platform and the CPU's model and flags.

A warm start reads the key, loads the program and runs it: nothing is traced or lowered. After an edit to
fucina_jax (a new environment) the first call traces and lowers again, and finds the program of an unchanged
module without compiling. The programs are compiled with JAX's persistent cache bypassed: an executable that cache
hands back serializes without its compiled kernels (a reloaded copy fails to run), so only real compiles are kept.

The store is `fucina_jax_steps/` inside JAX's compilation cache directory (fucina_jax.load() turns that on:
~/.cache/fucina_jax/xla, or $FUCINA_JAX_CACHE_DIR), and is used only while that cache is on. It keeps the
KEEP_ENVIRONMENTS environments used last. Everything else goes to the plain jax.jit function: a call with tracers
(a step inside the user's own jit or grad), with Python scalars or other non-array leaves, with more than one
device, or with jax_disable_jit; and functions outside fucina_jax keep their programs in their process only (the
key does not cover their source). Attributes other than calling and `prepare` (`lower`, `trace`, `eval_shape`, ...)
are the jax.jit function's.

Every step counts its own traces (TRACED) and loads (LOADED): `events()`, their sum, moves across a call when that
call traced a step or loaded a program, the one number the timers read to tell a call that brought its program in
from one that only ran. `Step.prepare(*args)` brings the program of a call in without running it, so a
caller can time the two apart.

The files are trusted like JAX's own cache entries: loading one runs code from the user's cache directory. A file
that fails to load (truncated, from another jaxlib) is compiled again and overwritten.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import inspect
import logging
import os
import pickle
import platform
import sys
import tempfile
import threading
import time
import weakref

import jax
import numpy as np

__all__ = ["BACKGROUND", "COMPILED", "LOADED", "TRACED", "BackgroundPreparer", "PREPARER", "clear", "events", "jit", "spec_of"]

log = logging.getLogger(__name__)

# Traces of every step, per function name (Step.name): incremented by the traced function itself, each time JAX
# traces it (a call with a new shape or static value, `lower`/`trace`/`eval_shape`, a step inside another jit).
TRACED: collections.Counter = collections.Counter()
# Programs loaded from disk, per function name: a program brought in without a trace.
LOADED: collections.Counter = collections.Counter()
# Real XLA compiles of programs the store keeps, per function name (a program found by its lowered module is not one).
COMPILED: collections.Counter = collections.Counter()

SUBDIR = "fucina_jax_steps"
# Environments whose programs a store keeps (see _pruned).
KEEP_ENVIRONMENTS = 3
_bypass_lock = threading.Lock()
# JAX options that change no program: logging, and where and when the compilation cache stores entries.
_NEUTRAL_OPTIONS = ("log", "cache", "explain", "persistent")


def jit(fun=None, *, static_argnames=(), donate_argnames=()):
    """Decorator: `@aot.jit(static_argnames=..., donate_argnames=...)`, the jax.jit arguments it takes."""
    if fun is None:
        return functools.partial(jit, static_argnames=static_argnames, donate_argnames=donate_argnames)
    step = Step(fun, tuple(static_argnames), tuple(donate_argnames))
    _STEPS.add(step)
    return step


_STEPS: weakref.WeakSet = weakref.WeakSet()  # every Step, for clear()
# Programs brought in by prepare_in_background's thread, per function name (not in TRACED or LOADED: its traces and
# loads are no call's, so events() does not move for them).
BACKGROUND: collections.Counter = collections.Counter()
_local = threading.local()  # .background: this thread is the background preparer


_EVENTS = [0]  # sum(TRACED.values()) + sum(LOADED.values()), kept as they count (the decoder reads it every step)


def events() -> int:
    """sum(TRACED.values()) + sum(LOADED.values()): a change in it across a call means that call traced or loaded a
    program. A call that compiles a trace made before it (by `step.lower(...)` or `step.trace(...)` with the same
    arguments) does not move it: bring a program in ahead with `Step.prepare`."""
    return _EVENTS[0]


def spec_of(x):
    """An array's jax.ShapeDtypeStruct (what Step.prepare and Step.ready take in its place); anything else as is."""
    if _is_array(x):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=getattr(x, "weak_type", False))
    return x


class BackgroundPreparer:
    """One daemon thread that brings programs in (`Step.prepare`) while the caller goes on: `submit(step, key, args,
    kwargs)` queues a program once per (step, key) (key: `step.program_key(...)`; array arguments are taken as their
    shapes at once, so the caller may donate or free them), and `step.has(key)` then says whether it is in. Its traces and loads are counted in BACKGROUND,
    not in events(): no call of the caller's made them. A program that fails to prepare is reported as done, so a
    call brings it in (and raises) the usual way."""

    def __init__(self):
        self._queued: set = set()
        self._jobs = None
        self._thread = None
        self._stopped = False
        self._lock = threading.Lock()

    def wait_idle(self, timeout: float = 600.0) -> bool:
        """Wait until every submitted program is in (or failed); False on timeout. A benchmark calls it after its
        warm-up, so no background compile runs during a timed run."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._queued:
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def stop(self, timeout: float = 120.0) -> None:
        """No more jobs; wait (up to `timeout` s) for the one in progress: a process must not exit while this thread
        is inside XLA (the interpreter's teardown would abort it). Runs at exit (atexit)."""
        with self._lock:
            self._stopped = True
            thread, jobs = self._thread, self._jobs
        if thread is not None:
            jobs.put(None)
            thread.join(timeout)

    def submit(self, step: Step, key, args: tuple, kwargs: dict) -> None:
        with self._lock:
            if self._stopped or (step.name, key) in self._queued:
                return
            self._queued.add((step.name, key))
            if self._jobs is None:
                import atexit
                import queue

                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._run, name="fucina-prepare", daemon=True)
                self._thread.start()
                atexit.register(self.stop)
        specs = jax.tree_util.tree_map(spec_of, (args, kwargs))
        self._jobs.put((step, key, specs))

    def _run(self) -> None:
        _local.background = True
        while True:
            job = self._jobs.get()
            if job is None or self._stopped:
                return
            step, key, (args, kwargs) = job
            try:
                step.prepare(*args, **kwargs)
                BACKGROUND[step.name] += 1
            except Exception as e:  # the call will bring it in and raise in its own thread
                log.warning("preparing %s in the background failed: %s", step.name, e)
                step._failed.add(key)
            with self._lock:
                self._queued.discard((step.name, key))


PREPARER = BackgroundPreparer()  # the process's one background preparer (its thread starts with the first job)


def clear() -> None:
    """Drop every compiled program this process holds: the Steps' and jax.jit's (jax.clear_caches). Each model shape
    compiles its own programs, and their machine code stays mapped while they are held; a process that loads many
    differently shaped models in turn runs out of memory maps (LLVM: "Unable to allocate section memory") unless
    it clears them. The next call of a step loads its program from the persistent store or compiles it again."""
    for step in list(_STEPS):
        step._programs.clear()
        step._failed.clear()
        step._recent.clear()
    jax.clear_caches()


class Step:
    """One jitted function; its compiled programs per (static arguments, argument structure and shapes)."""

    def __init__(self, fun, static_argnames: tuple[str, ...], donate_argnames: tuple[str, ...]):
        self.name = name = f"{fun.__module__}.{fun.__qualname__}"

        @functools.wraps(fun)  # fun's name, module and (through __wrapped__) signature: jax.jit sees fun's
        def counted(*args, **kwargs):
            if not getattr(_local, "background", False):
                TRACED[name] += 1  # runs only while JAX traces
                _EVENTS[0] += 1
            return fun(*args, **kwargs)

        self.jitted = jax.jit(counted, static_argnames=static_argnames, donate_argnames=donate_argnames)
        functools.update_wrapper(self, fun)
        self._params = list(inspect.signature(fun).parameters.values())
        self._static = frozenset(static_argnames)
        for p in self._params:
            if p.name not in self._static and p.kind is not p.POSITIONAL_OR_KEYWORD:
                raise TypeError(f"aot.jit: {self.name}'s array argument {p.name!r} must be positional-or-keyword")
        self._names = frozenset(p.name for p in self._params)
        # the key covers fucina_jax's files only: another module's function keeps its programs in this process
        self._persist = fun.__module__.split(".")[0] == "fucina_jax"
        self._programs: dict = {}  # (static, treedef, leaf signature) -> Compiled
        self._failed: set = set()  # keys the background preparer could not bring in (has() says True: calls do)
        self._recent: dict = {}  # _fast_key -> (static arguments, Compiled)

    def __getattr__(self, name):
        return getattr(self.jitted, name)

    def _cache_size(self) -> int:
        """Programs held, here and in the jax.jit function (jax.jit's own `_cache_size`, counting both paths)."""
        return len(self._programs) + self.jitted._cache_size()

    def __call__(self, *args, **kwargs):
        if _store() is None or jax.config.jax_disable_jit:
            return self.jitted(*args, **kwargs)
        split = self._split(args, kwargs)
        fast = None if split is None else _fast_key(*split)
        if fast is None:
            return self.jitted(*args, **kwargs)
        dyn, static = split
        hit = self._recent.get(fast)
        if hit is not None and all(a is b for (_, a), (_, b) in zip(hit[0], static)):
            try:
                return hit[1](*dyn)
            except TypeError:
                # arguments the fast key does not tell apart (other dtypes; a dict changed in place, or a freed
                # one's id reused): the program's argument check raises before anything runs or is donated, and
                # the full key below decides (the same program again re-raises its own error)
                pass
        keyed = self._keyed(dyn, static, _is_array)
        if keyed is None:  # inside a dict: a tracer (the caller's transformation) or a scalar; or unhashable statics
            return self.jitted(*args, **kwargs)
        exe = self._program(static, *keyed)
        if len(self._recent) > 64:
            self._recent.clear()
        self._recent[fast] = (static, exe)  # holds the static values: their ids stay theirs while the entry lives
        return exe(*dyn)

    def prepare(self, *args, **kwargs):
        """Bring in the program a call with these arguments would run, without running it: loaded from the store,
        or traced and compiled (and kept), so that the call itself only runs (`events()` does not move across it).
        Takes the call's arguments, arrays or jax.ShapeDtypeStructs in their place; nothing is donated or deleted.
        Returns the compiled program (None under jax_disable_jit, where a call compiles nothing).

        A call that would go to the plain jax.jit function (the store off, tracers, Python scalars, unhashable
        static values, ...) is prepared on that path: `jitted.trace(...).lower().compile()`, which leaves the
        trace, the lowering and the executable in jax.jit's own caches, where the call finds them."""
        if jax.config.jax_disable_jit:
            return None
        split = self._split(args, kwargs) if _store() is not None else None
        keyed = None if split is None else self._keyed(*split, _is_array_or_spec)
        if keyed is None:
            return self.jitted.trace(*args, **kwargs).lower().compile()
        return self._program(split[1], *keyed)

    def program_key(self, *args, **kwargs):
        """The key of the program a call with these arguments (arrays or jax.ShapeDtypeStructs) would run, for
        `has`; None where the call goes to the plain jax.jit function (the store off, tracers, ...)."""
        if jax.config.jax_disable_jit or _store() is None:
            return None
        split = self._split(args, kwargs)
        keyed = None if split is None else self._keyed(*split, _is_array_or_spec)
        if keyed is None:
            return None
        tree, leaves = keyed
        return split[1], tree, tuple(_leaf_signature(x) for x in leaves)

    def has(self, key) -> bool:
        """Whether the program of `program_key(...)` is in this process (called or prepared before): a call with
        those arguments only runs."""
        return key in self._programs or key in self._failed

    def _keyed(self, dyn: tuple, static: tuple, is_leaf_ok):
        """(treedef, leaves) of the array arguments, for _program; None to leave the call to jax.jit: an unhashable
        static value (jax.jit reports it), or a leaf is_leaf_ok refuses."""
        try:
            hash(static)
        except TypeError:
            return None
        leaves, tree = jax.tree_util.tree_flatten(dyn)
        if not all(type(x) in _array_types() or is_leaf_ok(x) for x in leaves):
            return None
        return tree, leaves

    def _split(self, args, kwargs):
        """(array arguments in signature order, ((name, value) of the static ones)), or None to leave the call to
        jax.jit (which also reports a bad call)."""
        if len(args) > len(self._params) or not self._names.issuperset(kwargs):
            return None
        dyn, static = [], []
        for i, p in enumerate(self._params):
            if i < len(args):
                v = args[i]
            elif p.name in kwargs:
                v = kwargs[p.name]
            elif p.default is not p.empty:
                v = p.default
            else:
                return None
            if p.name in self._static:
                static.append((p.name, v))
            else:
                dyn.append(v)
        return tuple(dyn), tuple(static)

    def _program(self, static: tuple, tree, leaves: list):
        key = (static, tree, tuple(_leaf_signature(x) for x in leaves))
        exe = self._programs.get(key)
        if exe is None:
            exe = self._programs[key] = self._bring_in(static, tree, leaves, key)
        return exe

    def _bring_in(self, static: tuple, tree, leaves: list, key):
        """The program for a key new to this process: the store's (no trace), else traced and lowered, then the
        store's program of that lowered module (no compile), else compiled and kept."""
        key_path = _key_path(self.name, key) if self._persist else None
        if key_path:
            exe = _read_program(_read_key(key_path))
            if exe is not None:
                if not getattr(_local, "background", False):
                    LOADED[self.name] += 1
                    _EVENTS[0] += 1
                return exe
        lowered = self.jitted.trace(*tree.unflatten(leaves), **dict(static)).lower()
        if not key_path:
            return lowered.compile()
        program_path = _program_path(self.name, lowered)
        exe = _read_program(program_path)
        if exe is None:
            with _xla_cache_bypassed() as bypassed:
                exe = lowered.compile()
            COMPILED[self.name] += 1
            if not bypassed or not _write_program(program_path, exe):
                return exe
        _atomic_write(key_path, os.path.basename(program_path).encode())
        return exe


@contextlib.contextmanager
def _xla_cache_bypassed():
    """Compile without JAX's persistent cache: an executable that cache hands back serializes without its compiled
    kernels (running it after a reload fails: "Function ... not found"), so only a real compile is kept. Yields
    whether the bypass took (it needs the cache module's two private flags; without them nothing is kept)."""
    try:
        from jax._src import compilation_cache as cc

        cc._cache_checked, cc._cache_used  # noqa: B018 - both flags must exist
    except (ImportError, AttributeError):
        yield False
        return
    with _bypass_lock:  # read and restored under the lock: another thread's bypass is never what is restored
        saved = cc._cache_checked, cc._cache_used
        cc._cache_checked, cc._cache_used = True, False
        try:
            yield True
        finally:
            cc._cache_checked, cc._cache_used = saved


def _leaf_signature(x):
    return x.shape, x.dtype, getattr(x, "weak_type", False)


def _fast_key(dyn: tuple, static: tuple):
    """The per-call key, cheaper than the full one (~20 us for a decode step's arguments, not ~0.4 ms): the static
    values by identity (the entry holds them; a new but equal value takes the slow path once), then per array
    argument its structure and leaf shapes, except that a dict argument (a params pytree: hundreds of leaves)
    stands for itself by id. What it leaves out (dtypes, a dict's contents) the program's own argument check
    catches (see __call__). None when some leaf is not an array, or is a tracer."""
    parts = [tuple(id(v) for _, v in static)]
    for v in dyn:
        if type(v) is dict:
            parts.append(id(v))
            continue
        leaves, tree = jax.tree_util.tree_flatten(v)
        for x in leaves:
            if type(x) not in _array_types() and not _is_array(x):
                return None
        parts.append((tree, tuple([x.shape for x in leaves])))
    return tuple(parts)


@functools.cache
def _array_types() -> frozenset:
    return frozenset({np.ndarray, type(jax.device_put(np.int32(0)))})


def _is_array(x) -> bool:
    return isinstance(x, (np.ndarray, np.generic, jax.Array)) and not isinstance(x, jax.core.Tracer)


def _is_array_or_spec(x) -> bool:
    """What Step.prepare takes in an array's place: the array, or its jax.ShapeDtypeStruct (the same signature)."""
    return _is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _store() -> str | None:
    """The directory the programs are kept in, or None while JAX's compilation cache is off (or on more than one
    device: sharded programs are left to jax.jit)."""
    if os.environ.get("FUCINA_JAX_NO_CACHE") or not jax.config.jax_enable_compilation_cache:
        return None
    base = jax.config.jax_compilation_cache_dir
    if not base or _n_devices() != 1:
        return None
    return os.path.join(os.fspath(base), SUBDIR)


@functools.cache
def _n_devices() -> int:
    return jax.device_count()


@functools.cache
def _platform() -> bytes:
    """What decides the executable XLA makes of a lowered module, beyond the module: JAX, XLA's flags, the CPU."""
    import jaxlib

    device = jax.devices()[0]
    return repr((jax.__version__, jaxlib.__version__, sys.version, platform.machine(), os.environ.get("XLA_FLAGS", ""),
                 device.platform, device.device_kind, device.client.platform_version, _cpu())).encode()


@functools.cache
def _environment() -> bytes:
    """What, beyond a call's own arguments, decides the lowered module: fucina_jax's files and JAX's options (and,
    through _platform, the rest)."""
    h = hashlib.sha256(_platform() + _native())
    for name, path in _package_files():
        if name.endswith((".py", ".c", ".cc", ".h", ".json")):
            with open(path, "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    options = sorted((k, repr(v)) for k, v in jax.config.values.items() if not any(w in k for w in _NEUTRAL_OPTIONS))
    h.update(repr(options).encode())
    return h.digest()


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags"))]
    except OSError:
        return platform.processor()
    return "\n".join(sorted(set(lines)))


def _env_tag() -> str:
    return _environment().hex()[:12]


def _key_path(name: str, key) -> str | None:
    """`<function>-<environment>-<key>.key`: the name of the program this call's key lowers to."""
    static, tree, leaves = key
    text = repr((name, static, str(tree), leaves))
    if " at 0x" in text:  # a static value without a stable repr: keep its program in this process only
        return None
    digest = hashlib.sha256(_environment() + text.encode()).hexdigest()[:32]
    return os.path.join(_store(), f"{_short(name)}-{_env_tag()}-{digest}.key")


@functools.cache
def _package_files() -> tuple[tuple[str, str], ...]:
    """(name, path) of every file of the fucina_jax package, in a fixed order (no __pycache__)."""
    root = os.path.dirname(os.path.abspath(__file__))
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        out += [(name, os.path.join(dirpath, name)) for name in sorted(filenames)]
    return tuple(out)


@functools.cache
def _native() -> bytes:
    """The built extensions (size and time of each .so): a program calls the kernels' FFI handlers, so one compiled
    against another build of them is not reused (a rebuilt kernel library with the same module text crashed in a
    stale program)."""
    stats = [(name, os.stat(path)) for name, path in _package_files() if name.endswith(".so")]
    return "\n".join(f"{name}\0{st.st_size}:{st.st_mtime_ns}" for name, st in stats).encode()


def _program_path(name: str, lowered) -> str:
    """`<function>-<fingerprint>.bin`: the executable of this lowered module and kernel build (the module text
    carries no source locations, so an edit that leaves the module alone finds its program), for these argument
    shapes: the module drops the arguments a program does not use (a raw greedy pick never reads the penalty
    history), so two signatures can lower to one text, and a program is called with the avals it was built for."""
    avals = repr(lowered.in_avals).encode()
    digest = hashlib.sha256(_platform() + _native() + avals + lowered.as_text().encode()).hexdigest()[:32]
    return os.path.join(_store(), f"{_short(name)}-{digest}.bin")


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _read_key(path: str, touch: bool = True) -> str | None:
    try:
        with open(path, "rb") as f:
            name = f.read(200).decode("ascii", "replace")
        if touch:
            os.utime(path)  # in use: kept by _pruned
    except OSError:
        return None
    return os.path.join(os.path.dirname(path), name) if name.endswith(".bin") and os.sep not in name else None


def _read_program(path: str | None):
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError:
        return None
    try:
        from jax.experimental import serialize_executable

        from fucina_jax import kernels

        if kernels.available():  # the programs call the kernels' FFI targets: they must be registered first
            kernels._register()
        serialized, in_tree, out_tree = pickle.loads(blob)
        return serialize_executable.deserialize_and_load(serialized, in_tree, out_tree)
    except Exception as e:  # noqa: BLE001 - any unreadable entry is compiled again and overwritten
        log.warning("fucina_jax: ignoring the unreadable compiled step %s (%s: %s)", path, type(e).__name__, e)
        return None


def _write_program(path: str, exe) -> bool:
    try:
        from jax.experimental import serialize_executable

        blob = pickle.dumps(serialize_executable.serialize(exe), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - an unserializable program only costs the next start
        log.debug("fucina_jax: not keeping the compiled step %s (%s: %s)", path, type(e).__name__, e)
        return False
    return _atomic_write(path, blob)


def _atomic_write(path: str, data: bytes) -> bool:
    """Best effort (an unwritable store only costs the next start); atomic: a concurrent reader sees all or none."""
    store = os.path.dirname(path)
    try:
        os.makedirs(store, exist_ok=True)
        _pruned(store)
        fd, tmp = tempfile.mkstemp(dir=store, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        log.debug("fucina_jax: not keeping %s (%s)", path, e)
        return False
    return True


@functools.cache
def _pruned(store: str) -> None:
    """Once per process and store, before its first write: delete the keys of all but the KEEP_ENVIRONMENTS
    environments used most recently (every change to fucina_jax's files is a new environment; a load touches its
    key, so an install in use stays), then the programs no key names, if older than an hour (a program is written
    before its key)."""
    try:
        entries = [(e.path, e.name, e.stat().st_mtime) for e in os.scandir(store) if e.name.endswith((".key", ".bin"))]
    except OSError:
        return
    keys = [(path, name.split("-")[1], mtime) for path, name, mtime in entries
            if name.endswith(".key") and name.count("-") == 2]
    latest: dict[str, float] = {_env_tag(): float("inf")}
    for _, tag, mtime in keys:
        latest[tag] = max(latest.get(tag, 0.0), mtime)
    kept = set(sorted(latest, key=latest.__getitem__, reverse=True)[:KEEP_ENVIRONMENTS])
    named = set()
    for path, tag, _ in keys:
        if tag not in kept:
            _unlink(path)
            continue
        program = _read_key(path, touch=False)
        if program:
            named.add(os.path.basename(program))
    for path, name, mtime in entries:
        if name.endswith(".bin") and name not in named and mtime < time.time() - 3600:
            _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
