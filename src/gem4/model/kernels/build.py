"""Building and loading the compiled CPU kernels (their ops: kernels/__init__.py), once per machine on first use.

Choices and why:
- Compiled on this machine on first use, not by pip at install time: an extension built by pip is tied to
  the torch ABI it was built against and breaks (or crashes) after a torch upgrade; built on first use
  and keyed by the torch version, an upgrade costs one rebuild. The build goes through torch's
  cpp_extension (`load`), which knows the include paths, defines and libraries of the torch installed.
- Into gem4's own cache, `$GEM4_CACHE/kernels/<key>/` (`gem4.paths`, default ~/.cache/gem4),
  where <key> digests the sources and headers, the compiler and linker flags, the CPU features required,
  the torch version and the Python version (`build_key`): two installs of the same code share a build,
  any change that matters gets its own.
- Explicit instruction sets (`ISA`), not -march=native: exactly the extensions the sources' intrinsics use
  (AVX-512 F/BW/VL, VNNI, BF16) plus those every AVX-512 CPU has that the compiler may use around them
  (AVX-512 DQ, AVX2, FMA, F16C, BMI1/2, LZCNT, POPCNT), tuned for `TUNE`. -march=native would enable
  whatever the CPU reports, AMX included on hosts whose VM does not enable it (those instructions trap).
  AMX is compiled into the panel GEMV and the prefill GEMM alone (function target attributes) and run only after
  the CPU reports AMX-TILE and AMX-INT8 (and AMX-BF16 for the GEMM) and Linux grants the tile state (arch_prctl
  ARCH_REQ_XCOMP_PERM). The same list is checked against /proc/cpuinfo before anything is built.
- Never hangs on a dead build: the builder holds an flock on `build.lock` (released by the kernel when its
  holder dies, even by SIGKILL); another process waits for a live holder with a message (`WAIT_LIMIT_S`
  at most). Each build runs in a fresh `build-*` directory (so torch's own `lock` baton file is always
  new; directories a dead builder left are removed under the flock), and the finished library is renamed
  into place: a library at its final path is always complete.
- Quick to compile: the sources include torch's narrow headers (`torch/library.h` for the op registrations,
  `ATen/core/Tensor.h`, `ATen/Parallel.h`, the `ATen/ops/*.h` of the functions called; `ATen/ATen.h` in
  decode_layer.cpp, which runs torch ops), never `torch/extension.h`: that one (pybind11 and torch's whole C++
  API, ~20 s of the compiler's time per source) is for Python modules, and this library is none (its ops are
  registered with TORCH_LIBRARY and loaded by torch.ops.load_library). ~40 s of compiler time in all instead of
  120-180 s; ninja runs the sources in parallel (ninja's own job count, or MAX_JOBS).
- Announced on stderr (with its expected time and how to skip it), then followed while it runs (`_Progress`:
  each source compiled, and at least every PROGRESS_EVERY_S the time so far and the sources left; on a terminal
  one line redrawn every second instead), and said when done. Any build or load failure is one
  stderr line naming the cause and the log (`build.log` in the key's directory); `load()` (kernels.available)
  is then False and callers keep the portable path (model/layers.py), which these kernels are tested against.
  `GEM4_NO_KERNELS=1` turns them off. `describe()` says which of these happened (`gem4 doctor`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

from gem4 import paths

SOURCES = [Path(__file__).with_name(name) for name in ("ggml_gemv.cpp", "bf16_gemv.cpp", "tile_gemm.cpp", "decode_ops.cpp",
                                                      "chunk_attention.cpp", "decode_layer.cpp", "mlx_affine.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("simd.h", "ops.h", "ggml_types.h", "kquants.h", "panels.h",
                                                      "tile_gemm.h")]
# compiler flag -m<key> -> the /proc/cpuinfo flag of the same extension
ISA = {
    "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512vl": "avx512vl",     # the intrinsics' base
    "avx512vnni": "avx512_vnni",                                              # vpdpwssd (Q8_0/Q4_0 GEMV)
    "avx512bf16": "avx512_bf16",                                              # vdpbf16ps, vcvtneps2bf16
    "avx512dq": "avx512dq", "avx2": "avx2", "fma": "fma", "f16c": "f16c",     # on every AVX-512 CPU: for the
    "bmi": "bmi1", "bmi2": "bmi2", "lzcnt": "abm", "popcnt": "popcnt",        # compiler's own code around them
}
CPU_FLAGS = frozenset(ISA.values())   # what the build needs of the CPU
TUNE = "icelake-server"               # scheduling only (no instruction set): the first AVX-512 server core with VNNI
# -fopenmp: at::parallel_for is an inline OpenMP loop; without the flag it silently runs serially
CFLAGS = ("-O3", *(f"-m{isa}" for isa in ISA), f"-mtune={TUNE}", "-fopenmp")
LDFLAGS = ("-fopenmp",)
LIBRARY = "gem4_kernels.so"
BUILD_TIME = "20-90 s on 2 cores"     # ~40 s of compiler time, ninja running the sources in parallel: 20-40 s
                                      # measured on 2 cores, more while other work shares them
PROGRESS_EVERY_S = 10.0               # the longest a build or a wait for one is silent on stderr through a pipe
WAIT_LIMIT_S = 1800                   # longest wait for another process's build before the portable path



def cpu_flags() -> set[str]:
    """The flags /proc/cpuinfo reports (none off Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def missing_cpu_flags() -> list[str]:
    """The /proc/cpuinfo flags the kernels need that this CPU does not report (all of them off Linux)."""
    return sorted(CPU_FLAGS - cpu_flags())


def python_version() -> str:
    return f"{sys.implementation.name}-{platform.python_version()}"


def build_key(cflags=CFLAGS, ldflags=LDFLAGS, cpu_flags=CPU_FLAGS, torch_version: str = torch.__version__,
              python: str | None = None) -> str:
    """Digest naming a build: sources + headers (names and bytes), flags, CPU features, torch and Python."""
    h = hashlib.sha256()
    for path in SOURCES + HEADERS:
        h.update(f"{path.name}:{path.stat().st_size}:".encode())
        h.update(path.read_bytes())
    inputs = [list(cflags), list(ldflags), sorted(cpu_flags), torch_version, python or python_version()]
    h.update(repr(inputs).encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    """`$GEM4_CACHE/kernels/<build_key>` (gem4.paths): the library, its build log and lock."""
    return paths.kernels_dir() / build_key()


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class KernelBuildError(RuntimeError):
    pass


_lock = threading.Lock()
_loaded: bool | None = None           # load()'s answer, once known
status = {"state": "not loaded yet", "reason": ""}   # how load() went (describe(), the ops' error message)


def load() -> bool:
    """Load the library, building it first where this machine has no build of these sources (kernels.available):
    once per process, whichever thread asks first. Whether it is loaded; status says why not."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _activate()
    return _loaded


def _activate() -> bool:
    if paths.no_kernels():
        status.update(state="off", reason="GEM4_NO_KERNELS is set")
        return False
    missing = missing_cpu_flags()
    if missing:
        status.update(state="off", reason="this CPU lacks " + " ".join(missing))
        return False
    directory = build_dir()
    try:
        status.update(state="active", reason=_load_or_build(directory))
        if paths.no_amx():
            torch.ops.gem4_kernels.set_amx(0)        # the op itself: kernels.set_amx() would wait for this load
        return True
    except Exception as e:    # any failure of the build or the load: the portable path, said once
        cause = _cause(e)
        status.update(state="failed", reason=cause)
        log = directory / "build.log"
        _say(f"gem4: warning: the compiled CPU kernels are unavailable ({cause}); using the portable path"
             + (f" (log: {log})" if log.is_file() else ""))
        return False


def _load_or_build(directory: Path) -> str:
    """Load the cached library, else build it under the flock; returns how it came to be loaded."""
    library = directory / LIBRARY
    if library.is_file():
        try:
            torch.ops.load_library(str(library))
            return f"loaded {library}"
        except Exception as e:     # e.g. a library a newer toolchain cannot load: rebuilt below
            load_error = f"{library} did not load: {_cause(e)}"
    else:
        load_error = ""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.lock", "a") as lock:
        _acquire(lock, directory)
        if library.is_file() and not load_error:          # built by the process we waited for
            torch.ops.load_library(str(library))
            return f"loaded {library} (built by another process)"
        for stale in directory.glob("build-*"):            # left by builders that died
            shutil.rmtree(stale, ignore_errors=True)
        _say(f"gem4: compiling the CPU kernels for this machine (once, {BUILD_TIME}; GEM4_NO_KERNELS=1 skips "
             f"this and runs on plain torch) into {directory} ...")
        start = time.monotonic()
        _build(directory, load_error)
        seconds = time.monotonic() - start
        _say(f"gem4: CPU kernels compiled in {seconds:.0f} s")
        return f"built {library} in {seconds:.0f} s"


def _acquire(lock, directory: Path) -> None:
    """flock(lock), waiting with a message while another live process holds it (WAIT_LIMIT_S at most)."""
    import fcntl

    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    _say(f"gem4: waiting for another process that is compiling the CPU kernels into {directory} ...")
    deadline = time.monotonic() + WAIT_LIMIT_S
    with _Progress(directory, waiting=True):
        while True:
            time.sleep(0.5)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise KernelBuildError(f"gave up after {WAIT_LIMIT_S} s waiting for the build holding "
                                           f"{directory / 'build.lock'}") from None


def compiled_sources(directory: Path) -> list[str]:
    """The sources a build in `directory` (a key's directory) has compiled so far: those whose object file is in
    a build-* directory there (torch's ninja file names it after the source; the assembler writes it last)."""
    return [p.name for p in SOURCES if any(directory.glob(f"build-*/{p.stem}.o"))]


class _Progress:
    """How a build in `directory` goes, on stderr while it runs (torch's load keeps ninja's own output until the
    end): on a terminal one line redrawn every second, erased at the end; through a pipe a line for each source
    compiled and, when nothing else was said for PROGRESS_EVERY_S, one with the time so far and what is left.
    waiting: the build is another process's (its build-* directory is watched the same way). A context manager:
    a thread watches from entry to exit; on exit, the sources compiled since its last look are said too."""

    TICK_S = 0.5

    def __init__(self, directory: Path, waiting: bool = False, stream=None):
        self.directory, self.waiting = directory, waiting
        self.stream = stream if stream is not None else sys.stderr
        try:
            self.tty = bool(self.stream.isatty())
        except (AttributeError, ValueError):
            self.tty = False
        self.start = self._last = time.monotonic()
        self._said: list[str] = []       # sources said to be compiled (pipe)
        self._drawn, self._width = "", 0  # the terminal line drawn last, the longest drawn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gem4-kernel-build-progress", daemon=True)

    def __enter__(self) -> "_Progress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self.tty:
            if self._width:
                self._write("\r" + " " * self._width + "\r")
        else:
            self._look(final=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.TICK_S):
            self._look()

    def _look(self, final: bool = False) -> None:
        compiled = compiled_sources(self.directory)
        now = time.monotonic()
        if self.tty:
            columns = shutil.get_terminal_size((80, 24)).columns - 1
            line = f"gem4:   {self.state(compiled, now - self.start)}"[:columns]
            if line != self._drawn:
                self._write("\r" + line.ljust(self._width))      # over the whole of the line before
                self._drawn, self._width = line, max(self._width, len(line))
            return
        if not self.waiting:
            for name in compiled:
                if name not in self._said:
                    self._said.append(name)
                    count = f"{len(self._said)}/{len(SOURCES)}"
                    self._write(f"gem4:   compiled {name} ({count}, {now - self.start:.0f} s)\n")
                    self._last = now
        if not final and now - self._last >= PROGRESS_EVERY_S:
            self._write(f"gem4:   {self.state(compiled, now - self.start)}\n")
            self._last = now

    def state(self, compiled: list[str], seconds: float) -> str:
        """One line: the time so far and what is left."""
        n = len(SOURCES)
        if self.waiting:
            return f"still waiting, {seconds:.0f} s (the other build: {len(compiled)}/{n} sources compiled)"
        if len(compiled) == n:
            return f"linking {LIBRARY}, {seconds:.0f} s"
        left = ", ".join(p.name for p in SOURCES if p.name not in compiled)
        return f"{len(compiled)}/{n} sources compiled, {seconds:.0f} s (left: {left})"

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):    # stderr closed: the build goes on unsaid
            pass


def _build(directory: Path, note: str) -> None:
    """Compile into a fresh build-* directory (torch's load also loads the result there), then rename the
    library into place. Everything the build says goes to build.log."""
    from torch.utils.cpp_extension import load

    work = Path(tempfile.mkdtemp(prefix="build-", dir=directory))
    torch_log = logging.getLogger("torch.utils.cpp_extension")   # its compiler warnings go to our log
    handler, propagate = None, torch_log.propagate
    with open(directory / "build.log", "w") as log:
        log.write(f"gem4 kernels, {time.strftime('%Y-%m-%d %H:%M:%S')}, pid {os.getpid()}\n{note}\n"
                  f"compiler: {_compiler()}\ntorch {torch.__version__}, {python_version()}\n"
                  f"cflags: {' '.join(CFLAGS)}\nldflags: {' '.join(LDFLAGS)}\nbuild directory: {work}\n\n")
        log.flush()
        try:
            handler = logging.StreamHandler(log)
            torch_log.addHandler(handler)
            torch_log.propagate = False
            with warnings.catch_warnings(record=True) as caught, _Progress(directory):   # before work is removed
                warnings.simplefilter("always")
                _check_compiler()
                load(name="gem4_kernels", sources=[str(p) for p in SOURCES], extra_cflags=list(CFLAGS),
                     extra_ldflags=list(LDFLAGS), build_directory=str(work), is_python_module=False, verbose=False)
            for w in caught:
                log.write(f"warning: {w.message}\n")
            built = sorted(work.glob("*.so"))   # gem4_kernels.so (torch names a second build in a process _v1)
            if len(built) != 1:
                raise KernelBuildError(f"the build left {len(built)} libraries in {work}")
            os.replace(built[0], directory / LIBRARY)
            log.write("built\n")
        except Exception as e:
            log.write(f"{type(e).__name__}: {e}\n")
            raise
        finally:
            if handler is not None:
                torch_log.removeHandler(handler)
            torch_log.propagate = propagate
            shutil.rmtree(work, ignore_errors=True)


def _cause(e: BaseException) -> str:
    """One line naming why a build or load failed: the compiler's first error, else the failed step."""
    text = str(e) + (f": {e.__cause__}" if e.__cause__ is not None else "")   # load_library's OSError wraps dlerror's
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    if lines[0].startswith("Error building extension"):
        errors = [line for line in lines[1:] if "error" in line.lower()]
        failed = [line for line in lines if line.startswith("FAILED:")]
        if errors:
            return "compile error: " + errors[0][:200]
        if failed:
            return (f"the compiler ({_cxx()}) failed on "
                    f"{failed[0].removeprefix('FAILED:').strip()[:120]}")
        return "build failed: " + lines[-1][:200]
    return lines[0][:240]


def _cxx() -> str:
    """The compiler torch's build runs: $CXX, else c++."""
    try:
        from torch.utils.cpp_extension import get_cxx_compiler

        return get_cxx_compiler()
    except ImportError:      # older torch
        return os.environ.get("CXX", "c++")


def _check_compiler() -> None:
    """Refuse a compiler that is missing or does not run, with its own words (torch's check would print
    them on our stderr and raise without them)."""
    cxx = _cxx()
    if shutil.which(cxx) is None:
        raise KernelBuildError(f"no C++ compiler: {cxx} not found (set CXX or install g++)")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"the C++ compiler {cxx} does not run: {e}") from e
    if out.returncode != 0:
        said = (out.stderr.strip() or out.stdout.strip() or f"exit status {out.returncode}").splitlines()[0]
        raise KernelBuildError(f"the C++ compiler {shutil.which(cxx)} does not run: {said[:200]}")


def _compiler() -> str:
    """The compiler's path and first --version line, or why there is none."""
    cxx = _cxx()
    path = shutil.which(cxx)
    if path is None:
        return f"{cxx}: not found"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
        version = (out.stdout.splitlines() or [f"--version: exit status {out.returncode}"])[0]
    except (OSError, subprocess.SubprocessError) as e:
        version = f"--version failed: {e}"
    return f"{path} ({version})"


def describe() -> dict:
    """Which kernels are active and why (`gem4 doctor`); loads or builds them first, as a run would."""
    active = load()
    present = cpu_flags()
    directory = build_dir()
    return {
        "active": active,
        "state": status["state"],
        "reason": status["reason"],
        "GEM4_NO_KERNELS": os.environ.get("GEM4_NO_KERNELS", "(unset)"),
        "cpu_flags_present": sorted(CPU_FLAGS & present),
        "cpu_flags_missing": sorted(CPU_FLAGS - present),
        "compiler": _compiler(),
        "ninja": shutil.which("ninja") or "not found",
        "cflags": " ".join(CFLAGS),
        "cache_dir": str(directory),
        "key": directory.name,
        "library": str(directory / LIBRARY) if (directory / LIBRARY).is_file() else "(not built)",
        "build_log": str(directory / "build.log") if (directory / "build.log").is_file() else "(none)",
        "torch": torch.__version__,
        "python": python_version(),
        "threads": torch.get_num_threads(),
    }

