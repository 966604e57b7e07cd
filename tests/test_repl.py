"""`gem4 chat` on a terminal: line editing, history, multi-line turns, Ctrl-C / Ctrl-D, type-ahead.

Each session runs `gem4 chat --demo --dtype float32 --temperature 0` in a pseudo-terminal (stdlib
`pty.fork`, so Ctrl-C is a real terminal interrupt) and is driven with the bytes a terminal sends.
What the model was asked is observed through what it answers: the expected replies are computed
in-process with the same engine, greedy, over the history the session should hold. The output is
cut at prompt_toolkit's bracketed-paste switches (on when a prompt is drawn, off when it is done),
so `after[i]` is exactly what was printed between prompt i and prompt i + 1.
"""
from __future__ import annotations

import codecs
import fcntl
import io
import json
import os
import pty
import re
import select
import signal
import stat
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from prompt_toolkit.history import FileHistory, InMemoryHistory

import gem4
from gem4.repl import PlainReader, TerminalReader, history_path, turn_reader

PROMPT_ON, PROMPT_OFF = "\x1b[?2004h", "\x1b[?2004l"      # prompt_toolkit: prompt drawn / prompt done
UP, LEFT, ALT_ENTER, CTRL_C, CTRL_D = "\x1b[A", "\x1b[D", "\x1b\r", "\x03", "\x04"
STATS = r"prompt: \d+ tokens, \d+ cached, [\d.]+ tok/s \| generated: \d+ tokens, [\d.]+ tok/s \| TTFT: \d+ ms \| finish: length\r\n"
STEP_S, START_S = 90, 240                                  # generous bounds for a loaded 2-core machine


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A GEM4_CACHE with the demo checkpoint built once for this module's sessions."""
    root = tmp_path_factory.mktemp("gem4-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GEM4_CACHE", str(root))
        from gem4.demo import ensure_demo

        ensure_demo()
    return root


@pytest.fixture(scope="module")
def demo_engine(cache):
    from gem4.demo import DEMO_VERSION

    return cache / f"demo-{DEMO_VERSION}"


EXPECTED = """
import io, json, sys
import gem4
from gem4 import Engine, SamplingParams
from gem4.chat import encode_prompt
from gem4.cli import _stream_chat, assistant_message
directory, turns, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
tok = gem4.Tokenizer.from_file(directory)
engine = Engine(gem4.load(directory, dtype="float32"), tok, enable_prefix_caching=False)
history, replies = [], []
for text in turns:
    if text == "/reset":
        history = []
        replies.append("")
        continue
    turn = history + [{"role": "user", "content": text}]
    out = io.StringIO()
    params = SamplingParams(temperature=0, top_k=64, top_p=0.95, max_tokens=max_tokens)
    result, _, _ = _stream_chat(engine, tok, encode_prompt(tok, turn), params, out)
    history = turn + [assistant_message(result)]
    replies.append(out.getvalue())
print(json.dumps(replies))
"""


def expected_replies(directory, turns: list[str], max_tokens: int) -> list[str]:
    """What `gem4 chat` prints for each turn (commands print nothing here), greedy, as cmd_chat keeps history.
    Computed in a fresh process, as the chat runs, without the prefix cache (as the sessions below): float32
    GEMMs may round a row differently in a process whose heap other tests have shaped, and on this random
    model a near-tie then parts the texts."""
    proc = subprocess.run([sys.executable, "-c", EXPECTED, str(directory), json.dumps(turns), str(max_tokens)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def on_tty(text: str) -> str:
    return text.replace("\n", "\r\n")                      # the terminal's ONLCR


class Terminal:
    """A child process on a pseudo-terminal (200x50); reads its output with deadlines, never blocks."""

    def __init__(self, argv: list[str], env: dict):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:                                  # child: the pty is its controlling terminal
            try:
                fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.raw = ""
        self.prompts = 0
        self.eof = False

    def _pump(self, deadline: float) -> None:
        wait = max(0.0, deadline - time.monotonic())
        if self.eof or not select.select([self.fd], [], [], min(wait, 0.2))[0]:
            return
        try:
            data = os.read(self.fd, 65536)
        except OSError:                                    # EIO: the child closed the terminal
            data = b""
        if not data:
            self.eof = True
        self.raw += self.decoder.decode(data)

    def wait_until(self, done, what: str, timeout: float = STEP_S) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if self.eof or time.monotonic() > deadline:
                raise AssertionError(f"no {what} after {timeout} s{' (the process ended)' if self.eof else ''}; "
                                     f"output ends with {self.raw[-1500:]!r}")
            self._pump(deadline)

    def wait_prompt(self, timeout: float = STEP_S) -> None:
        self.prompts += 1
        self.wait_until(lambda: self.raw.count(PROMPT_ON) >= self.prompts, f"prompt #{self.prompts}", timeout)

    def current(self) -> str:
        """What was printed since the latest prompt was done ("" while it is still open)."""
        parts = self.raw.split(PROMPT_OFF)
        return parts[self.prompts].split(PROMPT_ON)[0] if len(parts) > self.prompts else ""

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def after_prompts(self) -> list[str]:
        return [part.split(PROMPT_ON)[0] for part in self.raw.split(PROMPT_OFF)[1:]]

    def exit_code(self, timeout: float = STEP_S) -> int:
        self.wait_until(lambda: self.eof, "end of output", timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.pid = 0
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        raise AssertionError("the process closed its terminal but did not exit")

    def close(self) -> None:
        if self.pid:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.pid = 0
        os.close(self.fd)


@pytest.fixture
def chat(cache):
    """Starts `gem4 chat --demo` on a terminal; `chat(*args)` -> Terminal at its first prompt."""
    script = Path(sys.executable).with_name("gem4")
    assert script.exists(), f"the gem4 console script is not installed next to {sys.executable}"
    env = dict(os.environ, GEM4_CACHE=str(cache), TERM="xterm-256color",
               PROMPT_TOOLKIT_NO_CPR="1")                  # no cursor-position queries: nobody answers them here
    terminals = []

    def start(*args: str) -> Terminal:
        term = Terminal([str(script), "chat", "--demo", "--dtype", "float32", "--temperature", "0",
                         "--no-enable-prefix-caching", *args], env)
        terminals.append(term)
        term.wait_prompt(START_S)
        return term

    yield start
    for term in terminals:
        term.close()


def test_editing_history_and_multiline_turns(chat, cache, demo_engine):
    seeded = "a turn from an earlier session"
    history_file = cache / "chat_history"
    history_file.unlink(missing_ok=True)
    FileHistory(str(history_file)).store_string(seeded)

    steps = [(UP + "\r", seeded),                                      # recalled from the history file
             ("helo" + LEFT + "l\r", "hello"),                          # edited with the cursor
             (UP + "\r", "hello"),                                      # recalled from this session
             ("abc" + CTRL_C, None),                                    # dropped; the session goes on
             ("/reset\r", "/reset"),
             ("first\\\rsecond\r", "first\nsecond"),                    # a backslash continues the line
             ("/reset\r", "/reset"),
             ("one" + ALT_ENTER + "two\r", "one\ntwo"),
             ("/reset\r", "/reset"),
             ("\x1b[200~alpha\nbeta\n\x1b[201~\r", "alpha\nbeta")]        # a bracketed paste of two lines, Enter
    replies = expected_replies(demo_engine, [turn for _, turn in steps if turn is not None], 8)
    assert replies[1] != expected_replies(demo_engine, [seeded, "helo"], 8)[1]   # the edit shows in the reply
    expect, left = [], iter(replies)
    for _, turn in steps:
        reply = next(left) if turn is not None else ""
        expect.append("" if turn is None else r"\(history cleared\)\r\n" if turn == "/reset"
                      else re.escape(on_tty(reply)) + STATS)

    term = chat("-n", "8")
    assert "end a line with \\ or press Alt-Enter" in term.raw           # the help line names the keys
    for keys, _ in steps:
        term.send(keys)
        term.wait_prompt()
    term.send(CTRL_D)
    assert term.exit_code() == 0

    after = term.after_prompts()
    assert len(after) == len(steps) + 1 and after[-1] == ""                  # Ctrl-D prints nothing more
    for (keys, _), got, want in zip(steps, after, expect):
        assert re.fullmatch(want, got), f"after {keys!r}: {got!r} does not match {want!r}"

    kept = list(FileHistory(str(history_file)).load_history_strings())    # newest first
    assert [s.strip() for s in kept][:6] == ["alpha\nbeta", "/reset", "one\ntwo", "/reset", "first\nsecond", "/reset"]
    assert "hello" in kept and seeded in kept and "abc" not in kept


def test_interrupts_and_typeahead(chat, demo_engine):
    n = 400                                                # ~2 s of reply at full speed: time to type into it
    turns = ["hi", "ok", "and now?"]                       # "go on" is interrupted and not kept
    replies = expected_replies(demo_engine, turns, n)
    term = chat("-n", str(n))

    term.send("hi\r")
    first = on_tty(replies[0])[:8]
    term.wait_until(lambda: first in term.current(), "start of the first reply")
    term.send("zqxj")                                      # typed during the reply: neither echoed nor kept
    term.wait_prompt()
    term.send("ok\r")
    term.wait_prompt()

    term.send("go on\r")
    term.wait_until(lambda: len(term.current()) >= 8, "start of the reply to interrupt")
    started = term.current()
    term.send(CTRL_C)
    term.wait_prompt()
    term.send("and now?\r")
    term.wait_prompt()
    term.send(CTRL_D)
    assert term.exit_code() == 0

    after = term.after_prompts()
    assert len(after) == 5
    for i, (got, reply) in enumerate(zip([after[0], after[1], after[3]], replies)):
        assert re.fullmatch(re.escape(on_tty(reply)) + STATS, got), f"turn {turns[i]!r}: {got!r}"
    interrupted = after[2]
    assert interrupted.startswith(started) and interrupted.endswith("(interrupted)\r\n")
    assert "prompt: " not in interrupted                   # no stats: the reply did not run to its end
    assert "zqxj" not in term.raw


def test_pipe_gets_the_plain_reader(tmp_path, monkeypatch):
    """Through a pipe one line is one turn, as scripts (and tests/test_cli.py) drive `gem4 chat`."""
    stdin, err = io.StringIO("first \\\nsecond\n"), io.StringIO()
    reader = turn_reader(stdin, err)
    assert isinstance(reader, PlainReader) and reader.help == ""
    assert [reader.read(), reader.read(), reader.read()] == ["first \\", "second", None]
    assert err.getvalue() == "> > > \n"
    monkeypatch.setenv("GEM4_CACHE", str(tmp_path))
    assert history_path() == tmp_path / "chat_history"


def test_history_file_is_private_or_in_memory(tmp_path):
    """A new history file is created 0600; one that cannot be created is reported and the editor keeps
    its history in memory for the session."""
    master, slave = pty.openpty()
    try:
        with open(slave, "r", closefd=False) as tty_in, io.StringIO() as err:
            fresh = tmp_path / "new" / "chat_history"
            reader = TerminalReader(tty_in, err, fresh)
            assert isinstance(reader.session.history, FileHistory) and err.getvalue() == ""
            assert stat.S_IMODE(fresh.stat().st_mode) == 0o600

            blocker = tmp_path / "file"
            blocker.write_text("")
            reader = TerminalReader(tty_in, err, blocker / "chat_history")
            assert isinstance(reader.session.history, InMemoryHistory)
            assert err.getvalue().startswith("(chat history not kept: ") and str(blocker) in err.getvalue()
    finally:
        os.close(master)
        os.close(slave)
