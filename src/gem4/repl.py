"""Reading one chat turn for `gem4 chat`: a line editor on a terminal, plain lines through a pipe.

`turn_reader()` picks the reader once per session:

- **Terminal** (stdin and stderr are ttys): a prompt_toolkit line editor. prompt_toolkit rather than
  the stdlib `readline` because it behaves the same wherever Python runs (readline is GNU readline on
  Linux, libedit on macOS, absent on Windows) and because it gives what a chat prompt needs without
  terminal tricks of our own: multi-line buffers (a pasted block arrives through bracketed paste and
  stays ONE turn; readline would send its first line), Alt-Enter key bindings, and Ctrl-C / Ctrl-D
  reported as exceptions.
    - Enter sends the turn; a line ending with `\\` continues on the next line (the backslash is
      dropped), and so does Alt-Enter (Esc then Enter); pasted text is inserted whole.
    - Left/Right, Home/End, Ctrl-A/E/K/U/W and the rest of the Emacs keys edit; Up/Down recall earlier
      turns, Ctrl-R searches them. History persists in `$GEM4_CACHE/chat_history` (the cache root
      of `gem4.demo`; the file is created private, 0600).
    - Ctrl-C at the prompt drops the line and prompts again; Ctrl-D on an empty line ends the session.
    - `replying()` wraps the reply: keys typed meanwhile are not echoed into the reply and are
      discarded when it ends (`tcflush(TCIFLUSH)`, plus prompt_toolkit's own type-ahead), so they
      never become the next turn. Ctrl-C still interrupts the reply (ISIG stays on).
  The prompt is drawn on stderr, like the plain prompt, so stdout holds only the model's text.
- **Pipe** (anything else): one line is one turn, read with `readline()`, the prompt `> ` on
  stderr, exactly as scripts and the tests drive it.

`read()` returns the turn's text (None at end of input); the caller strips it and decides what a
command is.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from gem4 import paths

try:
    import termios
except ImportError:                                    # not a POSIX system
    termios = None

PROMPT, CONTINUATION = "> ", ". "
EDITING_HELP = ("end a line with \\ or press Alt-Enter for a new line (pasted text stays one turn); "
                "Up recalls earlier turns; Ctrl-C stops a reply")


def history_path() -> Path:
    """Where the line editor keeps earlier turns: in the gem4 cache root (gem4.paths)."""
    return paths.chat_history()


class PlainReader:
    """One line per turn from a text stream (a pipe or a file); no editing, no history."""

    help = ""

    def __init__(self, stdin, err):
        self.stdin, self.err = stdin, err

    def read(self) -> str | None:
        self.err.write(PROMPT)
        self.err.flush()
        line = self.stdin.readline()
        if not line:                                   # end of input
            self.err.write("\n")
            return None
        return line.rstrip("\n")

    def replying(self):
        return contextlib.nullcontext()


class TerminalReader:
    """A prompt_toolkit session on the terminal (see the module docstring for the keys)."""

    help = EDITING_HELP

    def __init__(self, stdin, err, history_file: Path | None):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.input import create_input
        from prompt_toolkit.output import create_output

        self.fd = stdin.fileno()
        self.err = err
        history = InMemoryHistory()
        if history_file is not None:
            try:
                history_file.parent.mkdir(parents=True, exist_ok=True)
                os.close(os.open(history_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
                history = FileHistory(str(history_file))
            except OSError as e:
                err.write(f"(chat history not kept: {e})\n")
        self.session = PromptSession(
            PROMPT, prompt_continuation=CONTINUATION, history=history, key_bindings=_key_bindings(),
            input=create_input(stdin), output=create_output(stdout=err))

    def read(self) -> str | None:
        while True:
            try:
                return self.session.prompt()
            except KeyboardInterrupt:                  # Ctrl-C: drop the line, prompt again
                continue
            except EOFError:                           # Ctrl-D on an empty line
                return None

    @contextlib.contextmanager
    def replying(self):
        """During a reply: no echo of typed keys (Ctrl-C still signals); afterwards drop what was typed."""
        from prompt_toolkit.input.typeahead import clear_typeahead

        saved = None
        if termios is not None:                        # POSIX; elsewhere only prompt_toolkit's type-ahead goes
            try:
                saved = termios.tcgetattr(self.fd)
            except termios.error:
                pass
        if saved is not None:
            quiet = list(saved)
            quiet[3] &= ~termios.ECHO                  # lflag; ICANON and ISIG stay as they are
            termios.tcsetattr(self.fd, termios.TCSANOW, quiet)
        try:
            yield
        finally:
            if saved is not None:
                termios.tcflush(self.fd, termios.TCIFLUSH)
                termios.tcsetattr(self.fd, termios.TCSANOW, saved)
            clear_typeahead(self.session.input)


def _key_bindings():
    from prompt_toolkit.enums import DEFAULT_BUFFER
    from prompt_toolkit.filters import has_focus
    from prompt_toolkit.key_binding import KeyBindings

    kb = KeyBindings()
    editing = has_focus(DEFAULT_BUFFER)                # not while Ctrl-R search has the focus

    @kb.add("enter", filter=editing)
    def _enter(event) -> None:
        buffer = event.current_buffer
        before = buffer.document.text_before_cursor
        if before.endswith("\\") and not buffer.document.text_after_cursor.strip():
            buffer.delete_before_cursor(1)             # `...\` Enter: continue on a new line
            buffer.insert_text("\n")
        else:
            buffer.validate_and_handle()

    @kb.add("escape", "enter", filter=editing)
    def _newline(event) -> None:
        event.current_buffer.insert_text("\n")

    return kb


def turn_reader(stdin=None, err=None):
    """The reader for this session: TerminalReader when stdin and `err` are terminals, else PlainReader."""
    stdin = sys.stdin if stdin is None else stdin
    err = sys.stderr if err is None else err
    if stdin.isatty() and err.isatty():
        return TerminalReader(stdin, err, history_path())
    return PlainReader(stdin, err)
