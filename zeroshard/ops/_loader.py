"""Finds or builds the native kernels: installed module, else JIT build, else None.

Note [JIT cache and locking]: torch.utils.cpp_extension.load serialises builds of one
directory with a "lock" file baton, but that baton is a plain file: a process killed mid-build
leaves it behind and every later process waits on it forever. We therefore take our own
fcntl-based lock (released by the kernel when a holder dies) around the load, and while
holding it remove a baton left over by a dead builder, since no live builder can hold it.

Note [build progress]: setup.py does not compile by default (pip hides a build's output, so a
compile at install is a minute of silence), and cpp_extension.load without verbose prints
nothing while the compiler runs. So while a build runs, or while this process waits for another
one's, a line goes to stderr every ``_PROGRESS_EVERY_S`` seconds (files compiled so far, time).
A cache hit returns before ``_QUIET_FOR_S`` and prints nothing.

Note [kernel cache key]: a build directory is named by a digest of everything the build
depends on: the sources and every header beside them (by content), the flags, the include
paths (torch's and Python's, which differ between environments with the same torch version),
the compiler (``$CXX`` resolved, its size and mtime; nvcc for CUDA) and the environment
variables compilers read (CFLAGS, CPATH, ...). Keyed by Python and torch versions only, a
second environment sharing the cache rebuilt the one build in place, and ranks of a running
job waited minutes on the lock for a build they did not need. The sources' directory is part of
the key too: the build files name the sources by path, so two checkouts of the same code sharing
one cache each made the build stale for the other, and the build tool recompiled it in place on
every alternate use (measured: jobs of two checkouts waited 90-230 s each on the lock, and
timed out at 300 s under load). Each checkout now builds once and keeps its build.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

from ._build_spec import CPU_ADAM, CUDA_ADAM, KernelSpec, csrc_dir, cuda_unavailable_reason

_LOCK_TIMEOUT_S = 900.0
_PROGRESS_EVERY_S = 10.0
_QUIET_FOR_S = 1.5


@dataclass(frozen=True)
class KernelState:
    """What happened when one kernel was looked for."""

    name: str
    module: ModuleType | None
    source: str
    """"installed", "jit" or "none"."""
    reason: str
    """Why it is active (where it came from) or why it is not."""


def cache_dir() -> str:
    """Where JIT builds go: $ZEROSHARD_CACHE_DIR, $TORCH_EXTENSIONS_DIR/zeroshard, or ~/.cache/zeroshard."""
    import torch

    explicit = os.environ.get("ZEROSHARD_CACHE_DIR")
    if explicit:
        base = explicit
    elif os.environ.get("TORCH_EXTENSIONS_DIR"):
        base = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "zeroshard")
    else:
        base = os.path.join(os.path.expanduser("~"), ".cache", "zeroshard", "torch_extensions")
    # One subdirectory per interpreter and torch build: their ABIs are not interchangeable.
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}".replace("+", "_")
    return os.path.join(base, tag)


# Environment variables the compiler or torch's build reads (Note [kernel cache key]).
_BUILD_ENV = ("CXX", "CC", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "CPATH", "C_INCLUDE_PATH",
              "CPLUS_INCLUDE_PATH", "LIBRARY_PATH", "TORCH_CUDA_ARCH_LIST", "NVCC_FLAGS", "CUDA_HOME")
_SOURCE_EXTS = (".cpp", ".cc", ".h", ".hpp", ".inc", ".cu", ".cuh")


def _tool(name: str) -> str:
    """A compiler as the build finds it: its real path, size and mtime (a changed compiler
    changes the key without running it)."""
    found = shutil.which(name)
    if found is None:
        return f"{name}:missing"
    real = os.path.realpath(found)
    st = os.stat(real)
    return f"{name}:{real}:{st.st_size}:{st.st_mtime_ns}"


def build_key(spec: KernelSpec, root: str) -> str:
    """The digest of everything ``spec``'s build from the sources under ``root`` depends on
    (Note [kernel cache key])."""
    import torch
    from torch.utils import cpp_extension

    h = hashlib.sha256()

    def add(*parts: object) -> None:
        for part in parts:
            h.update(repr(part).encode())
            h.update(b"\0")

    add(sys.version, torch.__version__, torch.__file__, spec.sources, spec.cflags, spec.ldflags,
        spec.cuda_cflags, spec.cuda)
    add(cpp_extension.include_paths(), sysconfig.get_paths().get("include"))
    add(os.path.realpath(root))  # (the build files name the sources by path: Note [kernel cache key])
    add(_tool(os.environ.get("CXX", "c++")))
    if spec.cuda:
        add(_tool(os.path.join(cpp_extension.CUDA_HOME or "", "bin", "nvcc")))
    add([(k, os.environ.get(k)) for k in _BUILD_ENV])
    for directory in sorted({os.path.dirname(os.path.join(root, s)) for s in spec.sources}):
        for name in sorted(os.listdir(directory)):  # (headers too: the sources include them)
            if name.endswith(_SOURCE_EXTS):
                with open(os.path.join(directory, name), "rb") as f:
                    add(name, hashlib.sha256(f.read()).hexdigest())
    return h.hexdigest()[:16]


def build_dir(spec: KernelSpec, root: str) -> str:
    """Where ``spec`` is built just in time: one directory per build key."""
    return os.path.join(cache_dir(), f"{spec.jit_name}-{build_key(spec, root)}")


@contextlib.contextmanager
def build_lock(build_dir: str, timeout_s: float = _LOCK_TIMEOUT_S) -> Iterator[None]:
    """Exclusive, crash-safe ownership of ``build_dir``; see Note [JIT cache and locking]."""
    from filelock import FileLock

    os.makedirs(build_dir, exist_ok=True)
    with FileLock(build_dir + ".lock", timeout=timeout_s):
        stale_baton = os.path.join(build_dir, "lock")
        if os.path.exists(stale_baton):
            os.remove(stale_baton)
        yield


class _BuildProgress:
    """The progress lines of one just-in-time build; see Note [build progress]."""

    def __init__(self, spec: KernelSpec, build_dir: str) -> None:
        self._spec, self._dir = spec, build_dir
        self._t0 = time.monotonic()
        self._wall0 = time.time()
        self._done = threading.Event()
        self._spoke = False
        self.waiting = True
        """True until this process holds the build lock (another process may be compiling)."""
        self._thread = threading.Thread(target=self._run, name=f"zeroshard-build-{spec.jit_name}", daemon=True)

    def __enter__(self) -> _BuildProgress:  # noqa: PYI034 (typing.Self needs Python 3.11)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        if self._spoke:
            outcome = "failed" if exc[0] is not None else "ready"
            self._say(f"{outcome} after {time.monotonic() - self._t0:.0f} s")

    def _compiled(self) -> int:
        # ninja writes one object per source into the build directory; count this build's.
        try:
            return sum(1 for f in os.listdir(self._dir)
                       if f.endswith(".o") and os.path.getmtime(os.path.join(self._dir, f)) >= self._wall0 - 1)
        except OSError:
            return 0

    def _say(self, what: str) -> None:
        print(f"zeroshard: kernel {self._spec.jit_name}: {what}", file=sys.stderr, flush=True)

    def _run(self) -> None:
        if self._done.wait(_QUIET_FOR_S):
            return
        self._spoke = True
        self._say(f"compiling {len(self._spec.sources)} files (first use on this machine, then cached in "
                  f"{self._dir}; under a minute on 2 cores; ZEROSHARD_JIT_VERBOSE=1 shows the compiler)")
        while not self._done.wait(_PROGRESS_EVERY_S):
            elapsed = time.monotonic() - self._t0
            if self.waiting:
                self._say(f"waiting for another process that is compiling it, {elapsed:.0f} s")
            else:
                self._say(f"{self._compiled()}/{len(self._spec.sources)} files compiled, {elapsed:.0f} s")


def _jit_build(spec: KernelSpec) -> ModuleType:
    from torch.utils import cpp_extension

    root = csrc_dir()
    if root is None:
        raise RuntimeError("kernel sources (csrc/) are not shipped with this installation")
    where = build_dir(spec, root)
    sources = [os.path.join(root, s) for s in spec.sources]
    with _BuildProgress(spec, where) as progress, build_lock(where):
        progress.waiting = False
        cached = _load_cached(spec, where, sources)
        if cached is not None:
            return cached
        module = cpp_extension.load(
            name=spec.jit_name,
            sources=sources,
            extra_cflags=list(spec.cflags),
            extra_ldflags=list(spec.ldflags),
            extra_cuda_cflags=list(spec.cuda_cflags) or None,
            build_directory=where,
            with_cuda=spec.cuda,
            verbose=os.environ.get("ZEROSHARD_JIT_VERBOSE", "0") == "1",
        )
        _write_stamp(spec, where, sources)
        return module


# Note [reusing a cached build]: cpp_extension.load hands every load to ninja, which rebuilds
# everything when its own log was written by another ninja version (a `pip install` of the test
# extras brings the `ninja` wheel: `bash .ci/run` after the README's demo recompiled the kernel
# the demo had just built, 42 s). A build is therefore recorded in a stamp next to it (what it
# was built from), and a later process whose sources, flags and build are unchanged imports the
# library directly, without ninja (sources edited since, or other flags: ninja runs as before).
_STAMP = "zeroshard-build.json"


def _fingerprint(spec: KernelSpec, sources: list[str]) -> dict:
    import torch

    src_dir = os.path.dirname(sources[0])
    headers = sorted(f for f in os.listdir(src_dir) if f.endswith((".h", ".inc", ".cuh")))
    files = sources + [os.path.join(src_dir, h) for h in headers]
    return {"name": spec.jit_name, "sources": files, "mtimes": [os.path.getmtime(f) for f in files],
            "cflags": list(spec.cflags), "ldflags": list(spec.ldflags), "cuda_cflags": list(spec.cuda_cflags),
            "torch": torch.__version__, "python": sys.version}


def _library(spec: KernelSpec, build_dir: str) -> str:
    import sysconfig

    return os.path.join(build_dir, spec.jit_name + (sysconfig.get_config_var("SHLIB_SUFFIX") or ".so"))


def _write_stamp(spec: KernelSpec, build_dir: str, sources: list[str]) -> None:
    import json

    stamp = {**_fingerprint(spec, sources), "library_mtime": os.path.getmtime(_library(spec, build_dir))}
    tmp = os.path.join(build_dir, _STAMP + f".tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(stamp, f)
    os.replace(tmp, os.path.join(build_dir, _STAMP))


def _load_cached(spec: KernelSpec, build_dir: str, sources: list[str]) -> ModuleType | None:
    """The library a previous build left in ``build_dir``, when its stamp matches (Note
    [reusing a cached build]); None sends the load to ninja."""
    import json

    lib = _library(spec, build_dir)
    try:
        with open(os.path.join(build_dir, _STAMP), encoding="utf-8") as f:
            stamp = json.load(f)
        if stamp != {**_fingerprint(spec, sources), "library_mtime": os.path.getmtime(lib)}:
            return None
    except (OSError, ValueError):
        return None
    loader_spec = importlib.util.spec_from_file_location(spec.jit_name, lib)
    if loader_spec is None or loader_spec.loader is None:
        return None
    module = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(module)
    return module


def _stale_installed(spec: KernelSpec) -> str | None:
    """Why the module setup.py built is older than the sources next to it (editable
    installs), or None. A stale module would silently run old kernel code."""
    found = importlib.util.find_spec(f"zeroshard.ops.{spec.name}")
    root = csrc_dir()
    if found is None or not found.origin or root is None:
        return None
    built = os.path.getmtime(found.origin)
    src_dir = os.path.dirname(os.path.join(root, spec.sources[0]))
    # Headers count (the sources include them); CUDA files only for the CUDA kernel, docs never.
    exts = (".cpp", ".h", ".inc", ".cu", ".cuh") if spec.cuda else (".cpp", ".h", ".inc")
    newer = [f for f in sorted(os.listdir(src_dir))
             if f.endswith(exts) and not (not spec.cuda and f.startswith("cuda_"))
             and os.path.getmtime(os.path.join(src_dir, f)) > built]
    return f"installed module is older than csrc sources ({', '.join(newer)})" if newer else None


def _find(spec: KernelSpec) -> KernelState:
    if os.environ.get("ZEROSHARD_DISABLE_KERNELS", "0") == "1":
        return KernelState(spec.name, None, "none", "disabled by ZEROSHARD_DISABLE_KERNELS=1")
    installed_error = _stale_installed(spec)
    if installed_error is None:
        try:
            return KernelState(spec.name, importlib.import_module(f"zeroshard.ops.{spec.name}"),
                               "installed", "built by setup.py")
        except ModuleNotFoundError as exc:
            # The usual case: setup.py compiles only with ZEROSHARD_BUILD_KERNELS=1.
            installed_error = ("not built at install; ZEROSHARD_BUILD_KERNELS=1 builds it there"
                               if exc.name == f"zeroshard.ops.{spec.name}" else str(exc))
        except ImportError as exc:
            installed_error = str(exc)
    if os.environ.get("ZEROSHARD_NO_JIT", "0") == "1":
        return KernelState(spec.name, None, "none",
                           f"not installed ({installed_error}) and ZEROSHARD_NO_JIT=1")
    try:
        return KernelState(spec.name, _jit_build(spec), "jit",
                           f"built just in time in {cache_dir()} (setup.py module: {installed_error})")
    except Exception as exc:  # no compiler, headers, sources, ...: fall back, never crash
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        return KernelState(spec.name, None, "none", f"JIT build failed: {type(exc).__name__}: {first_line}")


class KernelRegistry:
    """Loads each kernel at most once per process and warns at most once per kernel."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[str, KernelState] = {}
        self._warned: set[str] = set()

    def cpu(self) -> KernelState:
        return self._get(CPU_ADAM, None)

    def cuda(self) -> KernelState:
        import torch

        reason = cuda_unavailable_reason()
        if reason is None and not torch.cuda.is_available():
            reason = "no CUDA device visible (torch.cuda.is_available() is False)"
        return self._get(CUDA_ADAM, reason)

    def _get(self, spec: KernelSpec, unavailable: str | None) -> KernelState:
        with self._lock:
            if spec.name not in self._states:
                self._states[spec.name] = (KernelState(spec.name, None, "none", unavailable)
                                           if unavailable else _find(spec))
            return self._states[spec.name]

    def warn_fallback(self, state: KernelState) -> None:
        """The single warning that says the pure-PyTorch path runs instead, and why."""
        with self._lock:
            if state.name in self._warned:
                return
            self._warned.add(state.name)
        warnings.warn(f"zeroshard.ops: fused Adam kernel {state.name} unavailable ({state.reason}); "
                      "using the pure-PyTorch path (same results, slower). "
                      "Run `python -m zeroshard.ops` for details.", RuntimeWarning, stacklevel=3)


REGISTRY = KernelRegistry()
