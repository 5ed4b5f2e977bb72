"""Child processes of the launch roles: started in their own process group, stopped with
SIGTERM, a bounded grace period, then SIGKILL.

Thread-safety: a `Child` is owned by the thread that started it; its output pump runs on a
daemon thread of its own and only prints.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence

__all__ = ["Child", "Interrupted", "run_role", "trap_signals"]


class Interrupted(Exception):
    """SIGINT or SIGTERM reached a launch role (it stops its children and exits)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def trap_signals() -> Callable[[], None]:
    """Turns SIGINT/SIGTERM into `Interrupted` in the main thread; returns the undo."""

    def on_signal(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for s, handler in old.items():
            signal.signal(s, handler)

    return restore


def run_role(body: Callable[[], int], label: str) -> int:
    """A role program's exit status: `body()` with SIGINT/SIGTERM trapped (130 when one
    arrives) and its setup errors (RuntimeError, TimeoutError, ValueError) printed behind
    `label` (status 1)."""
    restore = trap_signals()
    try:
        return body()
    except Interrupted:
        return 130
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"{label} {e}", flush=True)
        return 1
    finally:
        restore()


class Child:
    """A child process in a new session. With `prefix`, its stdout and stderr are merged and
    copied line by line to our stdout behind the prefix, and `on_line` sees each line;
    without, it writes to our stdout/stderr directly."""

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], prefix: str | None = None,
                 on_line: Callable[[str], None] | None = None) -> None:
        piped = prefix is not None
        self.popen = subprocess.Popen(
            list(cmd), env=dict(env), start_new_session=True,
            stdout=subprocess.PIPE if piped else None,
            stderr=subprocess.STDOUT if piped else None,
        )
        self._pump: threading.Thread | None = None
        if piped:
            self._pump = threading.Thread(target=self._copy, args=(prefix, on_line),
                                          daemon=True)
            self._pump.start()

    def _copy(self, prefix: str, on_line: Callable[[str], None] | None) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if on_line is not None:
                on_line(line)
            sys.stdout.write(f"{prefix} {line}\n")
            sys.stdout.flush()
        self.popen.stdout.close()

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None if still running after `timeout` seconds."""
        try:
            return self.popen.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float) -> int:
        """SIGTERM to the group, up to `grace` seconds, then SIGKILL; the exit status."""
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            if self.wait(grace) is None:
                self.signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(timeout=10.0)
        if self._pump is not None:
            self._pump.join(timeout=2.0)
        rc = self.popen.poll()
        return rc if rc is not None else -signal.SIGKILL
