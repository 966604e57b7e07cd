"""Compiled CPU kernels of the fast mode, built once per machine on first use.

- `repack(raw, n_out, k_in, ggml_type)`: GGML blocks -> the kernels' layout, once at load, lossless: Q8_0 / Q4_0
  in panels of 16 rows (`panels.h`; the same size, the row count padded to a multiple of 16), Q4_1 / Q5_0 /
  Q5_1 / Q4_K / Q5_K / Q6_K in "x16" rows (the same size give or take the padding of a row's last 16 blocks
  and, for Q4_K / Q5_K, their unpacked 6-bit scales; Q5_0 / Q5_1 high bits as Q5_K's; `ggml_gemv.cpp` and
  `kquants.h` describe it).
  `gemv(x, packed, ...)`: y = x @ W.T read straight from it (decode; on Q8_0 / Q4_0 panels passes of 2-8 rows
  of x run on AMX tiles where the CPU grants them, bit-identical to the VNNI kernel: `set_amx`); `gemv_multi`
  (Q, K, V from one input) and `gemv_glu` (gelu(gate) * up) fuse the calls that share x; `linear` is prefill's
  GEMM (`tile_gemm.cpp`: 32 rows of W at a time turned into bf16 and multiplied while in cache, on AMX tiles where
  granted; row-invariant: a row's result does not depend on the other rows); `dequant`: rows of W in float32 /
  bf16 (token tables).
- `gemv_bf16(x, w)` / `linear_bf16(x, w)`: the same products for bf16 weights as they are stored (`bf16_gemv.cpp`).
- `rms_norm`, `rms_norm_rope`, `attend`, `gelu_mul`, `softcap`: the decode step's small operations,
  one call each instead of several torch ops (`decode_ops.cpp`; shared SIMD helpers in `simd.h`).
- `attend_chunk`: a prefill chunk's attention with bf16 GEMMs, skipping key blocks no query of a block
  sees (`chunk_attention.cpp`).
- `decode_layer`: a whole decoder layer of a decode step in one call, the kernels above in the order the
  Python layer calls them (`decode_layer.cpp`, declarations shared through `ops.h`).

Build (choices and why):
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
  stderr line naming the cause and the log (`build.log` in the key's directory); `available()` is then
  False and callers keep the portable path (model/layers.py), which these kernels are tested against.
  `GEM4_NO_KERNELS=1` turns them off. `describe()` says which of these happened (`gem4 doctor`).
"""
from __future__ import annotations

import ctypes
import functools
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
from gem4.ggml import GGMLType

SOURCES = [Path(__file__).with_name(name) for name in ("ggml_gemv.cpp", "bf16_gemv.cpp", "tile_gemm.cpp", "decode_ops.cpp",
                                                      "chunk_attention.cpp", "decode_layer.cpp")]
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
PACKED_TYPES = frozenset({GGMLType.Q4_0, GGMLType.Q8_0,    # formats the compiled kernels read
                          GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
                          GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K})
PANEL_TYPES = frozenset({GGMLType.Q4_0, GGMLType.Q8_0})   # of those, packed in 16-row panels (panels.h):
                                                          # N padded to 16, no padding along k
LIBRARY = "gem4_kernels.so"
BUILD_TIME = "20-90 s on 2 cores"     # ~40 s of compiler time, ninja running the sources in parallel: 20-40 s
                                      # measured on 2 cores, more while other work shares them
PROGRESS_EVERY_S = 10.0               # the longest a build or a wait for one is silent on stderr through a pipe
WAIT_LIMIT_S = 1800                   # longest wait for another process's build before the portable path


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def missing_cpu_flags() -> list[str]:
    """The /proc/cpuinfo flags the kernels need that this CPU does not report (all of them off Linux)."""
    return sorted(CPU_FLAGS - _cpu_flags())


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
_active: bool | None = None           # available()'s answer, once known
_status = {"state": "not loaded yet", "reason": ""}


def available() -> bool:
    """True once the kernels are compiled and loaded (compiles on the first call of the first process,
    announced on stderr; later processes load the cached library). False, with the reason in describe(),
    when disabled, unsupported by the CPU or the build failed (then one warning on stderr)."""
    global _active
    if _active is None:
        with _lock:             # one build or load per process, whichever thread asks first
            if _active is None:
                _active = _activate()
    return _active


def _activate() -> bool:
    if paths.no_kernels():
        _status.update(state="off", reason="GEM4_NO_KERNELS is set")
        return False
    missing = missing_cpu_flags()
    if missing:
        _status.update(state="off", reason="this CPU lacks " + " ".join(missing))
        return False
    directory = build_dir()
    try:
        _status.update(state="active", reason=_load_or_build(directory))
        if paths.no_amx():
            torch.ops.gem4_kernels.set_amx(0)        # the op itself: set_amx() would wait for this activation
        return True
    except Exception as e:    # any failure of the build or the load: the portable path, said once
        cause = _cause(e)
        _status.update(state="failed", reason=cause)
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
    active = available()
    present = _cpu_flags()
    directory = build_dir()
    return {
        "active": active,
        "state": _status["state"],
        "reason": _status["reason"],
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


@functools.lru_cache(maxsize=None)
def _ops():
    if not available():
        raise RuntimeError(f"gem4's compiled kernels are unavailable ({_status['reason']}); load the model in "
                           "float32 mode")
    return torch.ops.gem4_kernels


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_heap(keep: bool = True) -> bool:
    """Let this process's heap keep the memory a prefill frees, so the next one reuses it (glibc only;
    False elsewhere, with no effect). keep=False hands it back (blocks from 128 KiB mapped fresh and unmapped
    on free, the heap top trimmed past 128 KiB): what a process within a memory limit wants, where a
    26B-A4B 512-token prefill otherwise leaves ~2 GB of temporaries in the heap. Each call sets the process's
    allocator anew (a model loaded later decides for all).

    By default glibc hands large blocks back to the kernel on free (fresh mmaps, a trimmed heap top),
    and every prefill page-faults its temporaries in again: ~200k faults, 0.1-0.25 s of a 512-token
    prefill (E2B Q8_0), measured. With blocks up to 32 MiB served from the heap and the heap top
    trimmed only past 1 GiB, the first prefill faults ~35k times and later ones a few thousand. The
    cost is resident memory the size of a prefill's temporaries that stays with the process.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return False
    mmap_threshold, trim_threshold = (32 << 20, 1 << 30) if keep else (128 << 10, 128 << 10)
    done = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    if not keep:
        malloc_trim(0)                                   # what the heap kept so far goes back now
    return done


def repack(raw: torch.Tensor, n_out: int, k_in: int, ggml_type: GGMLType) -> torch.Tensor:
    """GGML bytes of an [n_out, k_in] weight of a PACKED_TYPES type -> the kernels' layout, uint8 [rows, row_bytes]
    (Q8_0 / Q4_0: panels of 16 rows, the rows padded to a multiple of 16; the other types: x16 rows)."""
    return _ops().repack(raw.contiguous(), n_out, k_in, int(ggml_type))


def gemv(x: torch.Tensor, packed: torch.Tensor, n_out: int, k_in: int, ggml_type: GGMLType) -> torch.Tensor:
    """x [M, k_in] float32, packed weight -> x @ W.T [M, n_out] float32, activations quantized per 32-block:
    Q8_0 / Q4_0 (panels.h) to int8, scale amax / 127, round to nearest (GGML's Q8_0 activations: each value
    moves by at most half a step, 1/254 of the block's largest); the x16 types to int16 (2^-16 of it)."""
    return _ops().gemv(x, packed, n_out, k_in, int(ggml_type))


def gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ w.T for a bf16 weight w [N, K] -> [M, N] float32; x enters as two bf16 terms
    (hi + lo, ~16 bits), products summed in float32."""
    return _ops().gemv_bf16(x, w)


def linear(x: torch.Tensor, packed: torch.Tensor, n_out: int, k_in: int, ggml_type: GGMLType) -> torch.Tensor:
    """x [T, k_in] (rounded to bf16) @ W.T -> [T, n_out] float32 (prefill), row-invariant: each row's result is the
    same float whatever the other rows (tile_gemm.cpp); W turned into bf16 32 rows at a time."""
    return _ops().linear_packed(x.to(torch.bfloat16).contiguous(), packed, n_out, k_in, int(ggml_type))


def linear_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] (rounded to bf16) @ w.T for a bf16 weight [N, K] -> [T, N] float32 (prefill), row-invariant as `linear`."""
    return _ops().linear_bf16(x.to(torch.bfloat16).contiguous(), w)


def dequant(packed: torch.Tensor, k_in: int, ggml_type: GGMLType, dtype: torch.dtype,
            rows: torch.Tensor | None = None) -> torch.Tensor:
    """A packed weight -> its rows [R, k_in] in float32 (exact) or bfloat16: all the packed tensor's rows (Q8_0 /
    Q4_0 panels: padded to a multiple of 16 with zero rows), or those with the ids `rows` [R]."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequant gives float32 or bfloat16, not {dtype}")
    ids = None if rows is None else rows.to(torch.int64).contiguous()
    return _ops().dequant(packed.contiguous(), k_in, int(ggml_type), dtype == torch.bfloat16, ids)


def ggml_types() -> dict[str, tuple[int, int, int]]:
    """The GGML types the kernels know (ggml_types.h): name -> (type id, weights per block, bytes per block)."""
    names, ids, block_sizes, type_sizes = _ops().ggml_types()
    return {name: (i, b, t) for name, i, b, t in zip(names, ids, block_sizes, type_sizes)}


def set_amx(enable: bool | None = None) -> bool:
    """Whether GEMV passes of 2-8 rows over Q8_0 / Q4_0 weights and the prefill GEMM (`linear`, `linear_bf16`) run
    on AMX tiles (on by default where the CPU and kernel grant AMX, unless GEM4_NO_AMX is set: gem4.paths, applied
    when the library loads); enable=True / False
    switches (True only where granted). The two GEMVs give the same results bit for bit; the two GEMMs each its
    own (each row-invariant). The switch is for tests and benchmarks."""
    return bool(_ops().set_amx(-1 if enable is None else int(enable)))


def gemv_multi(x: torch.Tensor, packed: list[torch.Tensor], n_outs: list[int], k_in: int,
               ggml_type: GGMLType) -> list[torch.Tensor]:
    """The same x through several packed weights of one type: [x @ W_i.T], one pass over all their rows."""
    return _ops().gemv_multi(x, packed, n_outs, k_in, int(ggml_type))


def gemv_glu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, n_out: int, k_in: int, ggml_type: GGMLType) -> torch.Tensor:
    """gelu_tanh(x @ Gate.T) * (x @ Up.T) [M, n_out] float32, both weights packed, in one pass."""
    return _ops().gemv_glu(x, gate, up, n_out, k_in, int(ggml_type))


def gelu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(a) * b for float32 tensors of one shape."""
    return _ops().gelu_mul(a.contiguous(), b.contiguous())


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), float32."""
    return _ops().softcap(x.contiguous(), cap)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] float32 -> x * (mean(x^2) + eps)^-1/2 [* weight] [+ residual] (layers.rms_norm, one call)."""
    return _ops().rms_norm(x.contiguous(), weight, eps, None if residual is None else residual.contiguous())


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] float32, cos/sin [T, 1, d] -> apply_rope(rms_norm(x, weight, eps), cos, sin)."""
    return _ops().rms_norm_rope(x.contiguous(), weight, eps, cos, sin)


def attend(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, a) -> torch.Tensor:
    """q [T, nh, d] float32 against the bf16 KV storage [R, nkv, d] of several sequences; `a` (kv_cache.Attend)
    says which rows each query row sees -> [T, nh*d] float32 (layers.attention)."""
    return _ops().attend(q.contiguous(), k_store, v_store, a.key_rows, a.q_seq, a.q_lo, a.q_hi)


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """attend() for a prefill chunk, on bf16 dot products with float32 sums: q as two bf16 terms (hi + lo),
    the probabilities rounded to bf16; per block of query rows, the key rows no query of it sees are skipped."""
    return _ops().attend_chunk(q.contiguous(), k, v, mask.contiguous())


def decode_layer(x: torch.Tensor, ple: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 k_store: torch.Tensor, v_store: torch.Tensor, rows: torch.Tensor | None, a,
                 weights: list[torch.Tensor], dims: list[int], eps: float) -> torch.Tensor:
    """One decoder layer for a decode-sized x [T, H] float32 (decode_layer.cpp lists the arguments); writes
    this step's k/v into the storage at `rows` when the layer owns its KV, then attends as `a`
    (kv_cache.Attend) says."""
    return _ops().decode_layer(x, ple, cos, sin, k_store, v_store, rows, a.key_rows, a.q_seq, a.q_lo, a.q_hi,
                               weights, dims, eps)
