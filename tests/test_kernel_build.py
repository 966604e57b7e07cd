"""Building the compiled kernels: never hang, never crash, always leave a working `gem4 run`.

Each scenario runs gem4 in a subprocess with its own GEM4_CACHE, so the kernels' build directory is
fresh; a fake `c++` first on PATH (a script that fails at once) stands for a broken compiler and keeps
these tests to seconds instead of a full build. The one real compile here is killed with SIGKILL a
moment after it starts. The progress a build reports is checked on a fake build directory and through
torch's ninja with a fake `c++` that takes its time and writes no real objects.
"""
from __future__ import annotations

import fcntl
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gem4.model import kernels
from gem4.model.kernels import build

needs_cpu = pytest.mark.skipif(bool(build.missing_cpu_flags()),
                               reason=f"this CPU lacks {build.missing_cpu_flags()}: no build is attempted")
RUN_DEMO = [sys.executable, "-m", "gem4.cli", "run", "--demo", "-p", "hi", "-n", "4", "--seed", "0"]
AMX_MNEMONICS = ("ldtilecfg", "sttilecfg", "tileloadd", "tilestored", "tilerelease", "tilezero", "tdpb")


def env_with(cache: Path, fake_compiler: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "GEM4_NO_KERNELS")}
    env["GEM4_CACHE"] = str(cache)
    if fake_compiler is not None:
        env["PATH"] = f"{fake_compiler}{os.pathsep}{env['PATH']}"
    env.update(extra)
    return env


FAKE_COMPILERS = {
    # does not even run: `c++ --version` fails
    "not running": "echo 'fake-c++: error: this compiler is broken' >&2; exit 1",
    # runs, but every compile fails (a broken toolchain or missing headers)
    "failing": ('for a in "$@"; do case "$a" in --version|-dumpversion|-dumpfullversion)\n'
                '  echo "c++ (fake) 12.2.0"; exit 0;; esac; done\n'
                "echo 'gem4_fake.cpp:1:1: error: this compiler cannot compile' >&2; exit 1"),
}
CAUSES = {"not running": "fake-c++: error: this compiler is broken",
          "failing": "compile error: gem4_fake.cpp:1:1: error: this compiler cannot compile"}


@pytest.fixture(scope="module")
def fake_compilers(tmp_path_factory) -> dict[str, Path]:
    """Directories whose `c++` / `g++` are the scripts of FAKE_COMPILERS."""
    out = {}
    for kind, body in FAKE_COMPILERS.items():
        directory = tmp_path_factory.mktemp("fake-compiler")
        for name in ("c++", "g++"):
            script = directory / name
            script.write_text(f"#!/bin/sh\n{body}\n")
            script.chmod(0o755)
        out[kind] = directory
    return out


@pytest.fixture(scope="module")
def broken_compiler(fake_compilers) -> Path:
    return fake_compilers["not running"]


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory) -> Path:
    """The demo checkpoint, built once; each test's cache links to it."""
    cache = tmp_path_factory.mktemp("demo-cache")
    subprocess.run([sys.executable, "-c", "from gem4.demo import ensure_demo; ensure_demo()"],
                   env=env_with(cache), check=True, timeout=300)
    (demo,) = cache.glob("demo-*")
    return demo


def fresh_cache(tmp_path: Path, demo: Path) -> Path:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / demo.name).symlink_to(demo, target_is_directory=True)
    return cache


def key_dir(cache: Path, monkeypatch) -> Path:
    """The kernels' build directory a gem4 process with GEM4_CACHE=cache uses."""
    monkeypatch.setenv("GEM4_CACHE", str(cache))
    return build.build_dir()


def warnings_in(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "compiled CPU kernels are unavailable" in line]


def assert_ran_portable(result: subprocess.CompletedProcess, cause: str) -> None:
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "the run produced no text"
    (warning,) = warnings_in(result.stderr)                # one line, naming the cause and the log
    assert cause in warning and "log: " in warning
    assert Path(warning.rsplit("log: ", 1)[1].rstrip(")")).is_file()


# --- (c) the cache key -----------------------------------------------------------------------------


def test_build_key_names_everything_the_library_depends_on(monkeypatch, tmp_path):
    base = build.build_key()
    assert build.build_key() == base                                     # stable
    assert build.build_key(cflags=build.CFLAGS + ("-g",)) != base       # compiler flags
    assert build.build_key(ldflags=()) != base                           # linker flags
    assert build.build_key(cpu_flags=build.CPU_FLAGS - {"avx512_bf16"}) != base   # CPU features
    assert build.build_key(torch_version="9.9.9") != base                # torch (its ABI)
    assert build.build_key(python="cpython-3.99.0") != base              # Python
    monkeypatch.setenv("GEM4_CACHE", str(tmp_path))
    assert build.build_dir() == tmp_path / "kernels" / base


def test_build_key_follows_every_source_and_header(monkeypatch, tmp_path):
    base = build.build_key()
    for path in build.SOURCES + build.HEADERS:
        copy = tmp_path / path.name
        copy.write_bytes(path.read_bytes() + b"\n")
        monkeypatch.setattr(build, "SOURCES", [copy if p == path else p for p in build.SOURCES])
        monkeypatch.setattr(build, "HEADERS", [copy if p == path else p for p in build.HEADERS])
        assert build.build_key() != base, path.name
        monkeypatch.undo()


def test_flags_name_the_instruction_sets_and_never_native_or_amx():
    assert not any(f.startswith("-march") or "native" in f or "amx" in f for f in build.CFLAGS)
    for isa, cpu_flag in build.ISA.items():                  # what is compiled for is what is checked
        assert f"-m{isa}" in build.CFLAGS and cpu_flag in build.CPU_FLAGS
    # the intrinsics of the sources: AVX-512 F/BW/VL, VNNI (vpdpwssd) and BF16 (vdpbf16ps)
    assert {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"} <= build.CPU_FLAGS


def test_gem4_no_kernels_turns_them_off(tmp_path):
    code = "from gem4.model import kernels; print(kernels.available(), kernels.describe()['reason'])"
    out = subprocess.run([sys.executable, "-c", code], env=env_with(tmp_path, GEM4_NO_KERNELS="1"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False GEM4_NO_KERNELS is set"
    assert not (tmp_path / "kernels").exists()                # nothing built


# --- the built library -------------------------------------------------------------------------------


AMX_FUNCTIONS = ("void gem4_panels::amx_rows<", "void gem4_panels::amx_pass<", "gem4_tiles::amx_blocks(",
                 "gem4_tiles::load_tiles(", "gem4_tiles::release_tiles(")


@needs_cpu
def test_built_library_has_amx_instructions_only_in_the_amx_kernels():
    """AMX is compiled into the panel GEMV's gem4_panels::amx_rows / amx_pass and the prefill GEMM's
    gem4_tiles::amx_blocks (with its tile configuration and release) alone, run only once the CPU and kernel grant
    AMX: any other function with a tile instruction would trap on a host whose VM does not enable AMX."""
    assert kernels.available(), kernels.describe()["reason"]
    library = build.build_dir() / build.LIBRARY
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils, installed with the compiler) is needed to read the library"
    listing = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", str(library)], capture_output=True,
                             text=True, check=True, timeout=300).stdout
    function, mnemonics, amx_in = "", set(), set()
    for line in listing.splitlines():
        if line.endswith(">:"):                             # "000000000004f2c0 <function(args)>:"
            function = line.split("<", 1)[1][:-2]
        elif line.startswith(" ") and line.count("\t") == 1 and line.split("\t")[1].strip():
            mnemonic = line.split("\t")[1].split()[0]      # "  4f2ca:\tjg     4f713 <...>"
            mnemonics.add(mnemonic)
            if mnemonic.startswith(AMX_MNEMONICS):
                amx_in.add(function)
    assert "vpdpwssd" in mnemonics and "vdpbf16ps" in mnemonics     # the listing is read right
    assert amx_in and all(f.startswith(AMX_FUNCTIONS) for f in amx_in), sorted(amx_in)
    assert any(f.startswith("gem4_tiles::amx_blocks(") for f in amx_in), sorted(amx_in)


@needs_cpu
def test_doctor_says_active_and_where(capsys):
    from gem4.cli import main

    assert kernels.available(), kernels.describe()["reason"]
    assert main(["doctor"]) == 0
    report = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert report["active"] == "True" and report["state"] == "active"
    assert report["library"] == str(build.build_dir() / build.LIBRARY)
    assert report["key"] == build.build_key() and report["cpu_flags_missing"] == "(none)"


# --- (b) a broken compiler ---------------------------------------------------------------------------


@needs_cpu
@pytest.mark.parametrize("kind", list(FAKE_COMPILERS))
def test_broken_compiler_warns_once_and_runs_portable(kind, tmp_path, fake_compilers, demo_checkpoint, monkeypatch):
    cache = fresh_cache(tmp_path, demo_checkpoint)
    env = env_with(cache, fake_compilers[kind])
    result = subprocess.run(RUN_DEMO, env=env, capture_output=True, text=True, timeout=300)
    assert_ran_portable(result, CAUSES[kind])
    (notice,) = [line for line in result.stderr.splitlines() if "compiling the CPU kernels" in line]   # announced,
    assert build.BUILD_TIME in notice and "GEM4_NO_KERNELS=1" in notice      # with its time and how to skip it
    assert "this compiler" not in result.stderr.replace(warnings_in(result.stderr)[0], "")   # said once
    log = (key_dir(cache, monkeypatch) / "build.log").read_text()
    assert "this compiler" in log and str(fake_compilers[kind] / "c++") in log
    doctor = subprocess.run([sys.executable, "-m", "gem4.cli", "doctor"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert doctor.returncode == 0, doctor.stderr
    assert "failed" in doctor.stdout and CAUSES[kind] in doctor.stdout
    assert str(fake_compilers[kind] / "c++") in doctor.stdout          # which compiler was found


@needs_cpu
def test_library_that_does_not_load_is_rebuilt(tmp_path, broken_compiler, monkeypatch):
    directory = key_dir(tmp_path, monkeypatch)
    directory.mkdir(parents=True)
    (directory / build.LIBRARY).write_bytes(b"not a library")
    code = "from gem4.model import kernels; print(kernels.available())"
    out = subprocess.run([sys.executable, "-c", code], env=env_with(tmp_path, broken_compiler),
                         capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "False" and len(warnings_in(out.stderr)) == 1
    assert "compiling the CPU kernels" in out.stderr                      # a rebuild was tried ...
    assert "did not load" in (directory / "build.log").read_text()        # ... because of the bad library


# --- a live builder is waited for, with a message ----------------------------------------------------


@needs_cpu
def test_live_build_is_waited_for_with_a_message(tmp_path, broken_compiler, monkeypatch):
    directory = key_dir(tmp_path, monkeypatch)
    directory.mkdir(parents=True)
    code = "from gem4.model import kernels; print(kernels.available())"
    with open(directory / "build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)                                # a live builder
        waiter = subprocess.Popen([sys.executable, "-c", code], env=env_with(tmp_path, broken_compiler),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while not holds_open(waiter.pid, directory / "build.lock"):    # it has reached the lock
                assert waiter.poll() is None and time.monotonic() < deadline, waiter.communicate()
                time.sleep(0.2)
            time.sleep(1.0)
            assert waiter.poll() is None                                # still waiting, not failed ...
            assert not (directory / "build.log").exists()              # ... and not building
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    out, err = waiter.communicate(timeout=120)
    assert "waiting for another process that is compiling the CPU kernels" in err
    assert out.strip() == "False" and len(warnings_in(err)) == 1       # then builds (the broken compiler fails)


# --- progress while building ------------------------------------------------------------------------


def test_sources_include_narrow_torch_headers():
    """torch/extension.h (pybind11 and torch's whole C++ API) took ~20 s of each source's ~30 s to compile; the
    library is no Python module (TORCH_LIBRARY ops, torch.ops.load_library), so no source or header needs it."""
    for path in build.SOURCES + build.HEADERS:
        includes = re.findall(r"^#include\s*<([^>]+)>", path.read_text(), re.MULTILINE)
        assert "torch/extension.h" not in includes and "torch/torch.h" not in includes, path.name
        assert not any(i.startswith(("torch/csrc", "pybind11", "Python")) for i in includes), path.name


def test_build_is_never_silent_for_long():
    assert build.PROGRESS_EVERY_S <= 10 and build._Progress.TICK_S <= 1


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def compile_object(directory: Path, source: str) -> None:
    """What ninja leaves once a source is compiled: its object file in the build-* directory."""
    (directory / "build-test" / source.replace(".cpp", ".o")).write_bytes(b"")


def watch(monkeypatch, tmp_path, steps, stream, waiting=False) -> str:
    """stream's text after a _Progress over tmp_path (ticks of 20 ms, a pipe line after 0.3 s of silence) saw
    steps: (seconds to wait, sources to compile then)."""
    monkeypatch.setattr(build, "PROGRESS_EVERY_S", 0.3)
    monkeypatch.setattr(build._Progress, "TICK_S", 0.02)
    (tmp_path / "build-test").mkdir()
    with build._Progress(tmp_path, waiting=waiting, stream=stream):
        for seconds, sources in steps:
            time.sleep(seconds)
            for name in sources:
                compile_object(tmp_path, name)
    return stream.getvalue()


def test_progress_through_a_pipe_names_each_source_and_the_time(monkeypatch, tmp_path):
    names = [p.name for p in build.SOURCES]
    n = len(names)
    steps = [(0.45, []), (0.0, [names[2]]), (0.15, names[:2]), (0.45, []), (0.0, names[3:])]
    text = watch(monkeypatch, tmp_path, steps, io.StringIO())
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert all(line.startswith("gem4:   ") for line in lines)
    compiled = [re.fullmatch(rf"gem4:   compiled (\S+) \((\d)/{n}, \d+ s\)", line) for line in lines]
    said = [(m[1], int(m[2])) for m in compiled if m]
    # each source once, in the order they were compiled; the last ones seen on exit, not left out
    assert said == [(names[2], 1), (names[0], 2), (names[1], 3)] + [(name, i + 1) for i, name in enumerate(names) if i >= 3]
    quiet = [line for m, line in zip(compiled, lines) if not m]
    # a line after each silence of PROGRESS_EVERY_S: the time and what is left
    assert quiet[0].startswith(f"gem4:   0/{n} sources compiled, 0 s (left: " + ", ".join(names))
    assert any(line.startswith(f"gem4:   3/{n} sources compiled") and line.endswith(f"(left: {', '.join(names[3:])})")
               for line in quiet), quiet
    assert lines.index(quiet[0]) < lines.index(f"gem4:   compiled {names[2]} (1/{n}, 0 s)")


def test_progress_on_a_terminal_is_one_line_redrawn_then_erased(monkeypatch, tmp_path):
    names = [p.name for p in build.SOURCES]
    text = watch(monkeypatch, tmp_path, [(0.1, names[:2]), (0.1, names[2:]), (0.1, [])], Terminal())
    assert "\n" not in text and text.count("\r") >= 4
    frames = text.split("\r")[1:]
    n = len(names)
    assert frames[0].startswith(f"gem4:   0/{n} sources compiled, 0 s (left: ")
    assert any(f.startswith(f"gem4:   2/{n} sources compiled") for f in frames)
    assert any(f.startswith(f"gem4:   linking {build.LIBRARY}") for f in frames)
    assert frames[-2].strip() == "" and frames[-1] == ""                  # erased: the next line starts clean
    widths = [len(f) for f in frames[:-1]]
    assert widths == sorted(widths)                                       # each frame covers the one before
    assert len(set(frames)) == len(frames)                                # drawn again only when it changes


def test_progress_of_a_wait_says_how_the_other_build_goes(monkeypatch, tmp_path):
    names = [p.name for p in build.SOURCES]
    text = watch(monkeypatch, tmp_path, [(0.0, names[:1]), (0.45, [])], io.StringIO(), waiting=True)
    lines = text.splitlines()
    n = len(names)
    assert lines and all(re.fullmatch(rf"gem4:   still waiting, \d+ s \(the other build: 1/{n} sources compiled\)", line)
                         for line in lines), lines


SLOW_COMPILER = """\
out=""; dep=""; src=""; prev=""
for a in "$@"; do
  case "$a" in --version|-dumpversion|-dumpfullversion) echo "c++ (fake) 12.2.0"; exit 0;; esac
  case "$prev" in -o) out="$a";; -MF) dep="$a";; esac
  case "$a" in *.cpp) src="$a";; esac
  prev="$a"
done
case "$src" in *decode_layer.cpp) sleep 4;; ?*) sleep 0.3;; esac
if [ -n "$dep" ]; then echo "$out: $src" > "$dep"; fi
echo "not an object" > "$out"
"""


@needs_cpu
def test_a_build_says_each_source_and_is_never_silent_for_long(tmp_path):
    """A real build through torch's ninja, with a `c++` that takes 0.3 s a source and 4 s for decode_layer.cpp and
    writes no real objects (the library then does not load: one warning, the portable path). Each source is said
    once, and no two lines of the build are further apart than PROGRESS_EVERY_S (1 s here) and a tick."""
    compiler = tmp_path / "bin"
    compiler.mkdir()
    for name in ("c++", "g++"):
        (compiler / name).write_text("#!/bin/sh\n" + SLOW_COMPILER)
        (compiler / name).chmod(0o755)
    code = ("from gem4.model import kernels; from gem4.model.kernels import build; build.PROGRESS_EVERY_S = 1.0; "
            "print(kernels.available())")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env_with(tmp_path / "cache", compiler),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stamped = [(time.monotonic(), line.rstrip("\n")) for line in proc.stderr]
    assert proc.stdout.read().strip() == "False" and proc.wait(timeout=60) == 0
    lines = [line for _, line in stamped]
    start = next(i for i, line in enumerate(lines) if "compiling the CPU kernels" in line)
    assert "GEM4_NO_KERNELS=1" in lines[start]
    end = next(i for i, line in enumerate(lines) if "compiled CPU kernels are unavailable" in line)
    n = len(build.SOURCES)
    compiled = sorted(m[1] for m in (re.match(rf"gem4:   compiled (\S+) \(\d/{n}, \d+ s\)", line) for line in lines) if m)
    assert compiled == sorted(p.name for p in build.SOURCES), lines
    assert any(line.startswith(f"gem4:   {n - 1}/{n} sources compiled") and line.endswith("(left: decode_layer.cpp)")
               for line in lines), lines
    gaps = [b[0] - a[0] for a, b in zip(stamped[start:end], stamped[start + 1:end + 1])]
    assert max(gaps) < 1.0 + 1.0, list(zip(gaps, lines[start + 1:]))


# --- (a) a build killed with SIGKILL -----------------------------------------------------------------


def holds_open(pid: int, path: Path) -> bool:
    """Whether process pid has the file open (Linux /proc)."""
    try:
        return any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command name) of every process (Linux /proc)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        out[int(stat.parent.name)] = (int(text.rsplit(")", 1)[1].split()[1]), text.split("(", 1)[1].rsplit(")", 1)[0])
    return out


def descendants(pid: int) -> dict[int, str]:
    """pid's descendants -> their command names (ninja starts each compiler in a process group of its own,
    so a kill of the builder's group alone would leave them running)."""
    table, found, frontier = processes(), {}, {pid}
    while frontier:
        frontier = {child for child, (parent, _) in table.items() if parent in frontier and child not in found}
        found.update((child, table[child][1]) for child in frontier)
    return found


@needs_cpu
def test_build_killed_by_sigkill_does_not_block_the_next_run(tmp_path, broken_compiler, demo_checkpoint, monkeypatch):
    cache = fresh_cache(tmp_path, demo_checkpoint)
    directory = key_dir(cache, monkeypatch)
    builder = subprocess.Popen([sys.executable, "-c", "from gem4.model import kernels; kernels.available()"],
                               env=env_with(cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    tree: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 240
        while "cc1plus" not in tree.values():                           # the real compiler is at work
            assert builder.poll() is None and time.monotonic() < deadline, "the build did not start"
            time.sleep(0.2)
            tree = descendants(builder.pid)
    finally:
        started = descendants(builder.pid) | tree                       # the builder and everything it started
        os.killpg(builder.pid, signal.SIGKILL)
        for pid in started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        builder.wait()
    stale = list(directory.glob("build-*"))
    assert (directory / "build.lock").exists() and stale               # what a dead build leaves
    assert (stale[0] / "lock").exists()                                 # torch's own baton, never released
    assert not (directory / build.LIBRARY).exists()

    # the next run is not blocked by either lock: it builds again (here with the broken compiler, so in
    # seconds) and, the build failing, generates on the portable path
    result = subprocess.run(RUN_DEMO, env=env_with(cache, broken_compiler), capture_output=True, text=True,
                            timeout=300)
    assert_ran_portable(result, "this compiler is broken")
    assert "compiling the CPU kernels" in result.stderr and "waiting" not in result.stderr
    assert not any(p in stale for p in directory.glob("build-*"))       # the dead build's directory is gone
