"""Building the compiled kernels: never hang, never crash, always leave a working `gem4 run`.

Each scenario runs gem4 in a subprocess with its own GEM4_CACHE, so the kernels' build directory is
fresh; a fake `c++` first on PATH (a script that fails at once) stands for a broken compiler and keeps
these tests to seconds instead of a full build. The one real compile here is killed with SIGKILL a
moment after it starts.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gem4.model import kernels

needs_cpu = pytest.mark.skipif(bool(kernels.missing_cpu_flags()),
                               reason=f"this CPU lacks {kernels.missing_cpu_flags()}: no build is attempted")
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
    return kernels.build_dir()


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
    base = kernels.build_key()
    assert kernels.build_key() == base                                     # stable
    assert kernels.build_key(cflags=kernels.CFLAGS + ("-g",)) != base       # compiler flags
    assert kernels.build_key(ldflags=()) != base                           # linker flags
    assert kernels.build_key(cpu_flags=kernels.CPU_FLAGS - {"avx512_bf16"}) != base   # CPU features
    assert kernels.build_key(torch_version="9.9.9") != base                # torch (its ABI)
    assert kernels.build_key(python="cpython-3.99.0") != base              # Python
    monkeypatch.setenv("GEM4_CACHE", str(tmp_path))
    assert kernels.build_dir() == tmp_path / "kernels" / base


def test_build_key_follows_every_source_and_header(monkeypatch, tmp_path):
    base = kernels.build_key()
    for path in kernels.SOURCES + kernels.HEADERS:
        copy = tmp_path / path.name
        copy.write_bytes(path.read_bytes() + b"\n")
        monkeypatch.setattr(kernels, "SOURCES", [copy if p == path else p for p in kernels.SOURCES])
        monkeypatch.setattr(kernels, "HEADERS", [copy if p == path else p for p in kernels.HEADERS])
        assert kernels.build_key() != base, path.name
        monkeypatch.undo()


def test_flags_name_the_instruction_sets_and_never_native_or_amx():
    assert not any(f.startswith("-march") or "native" in f or "amx" in f for f in kernels.CFLAGS)
    for isa, cpu_flag in kernels.ISA.items():                  # what is compiled for is what is checked
        assert f"-m{isa}" in kernels.CFLAGS and cpu_flag in kernels.CPU_FLAGS
    # the intrinsics of the sources: AVX-512 F/BW/VL, VNNI (vpdpwssd) and BF16 (vdpbf16ps)
    assert {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"} <= kernels.CPU_FLAGS


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
    library = kernels.build_dir() / kernels.LIBRARY
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
    assert report["library"] == str(kernels.build_dir() / kernels.LIBRARY)
    assert report["key"] == kernels.build_key() and report["cpu_flags_missing"] == "(none)"


# --- (b) a broken compiler ---------------------------------------------------------------------------


@needs_cpu
@pytest.mark.parametrize("kind", list(FAKE_COMPILERS))
def test_broken_compiler_warns_once_and_runs_portable(kind, tmp_path, fake_compilers, demo_checkpoint, monkeypatch):
    cache = fresh_cache(tmp_path, demo_checkpoint)
    env = env_with(cache, fake_compilers[kind])
    result = subprocess.run(RUN_DEMO, env=env, capture_output=True, text=True, timeout=300)
    assert_ran_portable(result, CAUSES[kind])
    assert "compiling the CPU kernels" in result.stderr                 # the build was announced
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
    (directory / kernels.LIBRARY).write_bytes(b"not a library")
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
    assert not (directory / kernels.LIBRARY).exists()

    # the next run is not blocked by either lock: it builds again (here with the broken compiler, so in
    # seconds) and, the build failing, generates on the portable path
    result = subprocess.run(RUN_DEMO, env=env_with(cache, broken_compiler), capture_output=True, text=True,
                            timeout=300)
    assert_ran_portable(result, "this compiler is broken")
    assert "compiling the CPU kernels" in result.stderr and "waiting" not in result.stderr
    assert not any(p in stale for p in directory.glob("build-*"))       # the dead build's directory is gone
