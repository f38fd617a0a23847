"""Single keys from the terminal without Enter (cbreak mode), for the live dashboard.

Only when stdin is a TTY: under a pipe, in CI or inside `submit` without a terminal there are no keys
and `read` just waits. The terminal's mode is restored on exit, also after an exception.
"""

from __future__ import annotations

import os
import select
import sys
import time

# Escape sequences of the keys we use (xterm and tmux send these).
SEQUENCES = {
    "\x1b[A": "up", "\x1b[B": "down", "\x1b[5~": "pgup", "\x1b[6~": "pgdn",
    "\x1b[H": "home", "\x1b[F": "end", "\x1b[1~": "home", "\x1b[4~": "end",
    "\x1bOA": "up", "\x1bOB": "down",
}


class KeyReader:
    """`with KeyReader() as keys: keys.read(timeout)` -> list of key names ("q", "up", ...)."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.fd = sys.stdin.fileno() if _has_fileno(sys.stdin) else -1
        tty = self.fd >= 0 and os.isatty(self.fd)
        self.active = tty if enabled is None else (enabled and tty)
        self._saved: list | None = None

    def __enter__(self) -> KeyReader:
        if self.active:
            import termios
            import tty

            self._saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)
            self._saved = None

    def read(self, timeout: float) -> list[str]:
        """Keys pressed within `timeout` seconds (returns early on the first key)."""
        if not self.active:
            time.sleep(timeout)
            return []
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return []
        return parse_keys(os.read(self.fd, 64).decode(errors="replace"))


def parse_keys(data: str) -> list[str]:
    """Key names in `data`: escape sequences by name, other characters as themselves."""
    keys, i = [], 0
    while i < len(data):
        for seq, name in SEQUENCES.items():
            if data.startswith(seq, i):
                keys.append(name)
                i += len(seq)
                break
        else:
            keys.append(data[i])
            i += 1
    return keys


def _has_fileno(stream: object) -> bool:
    try:
        stream.fileno()  # type: ignore[attr-defined]
        return True
    except (AttributeError, OSError, ValueError):
        return False
