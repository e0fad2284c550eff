"""One long-lived process of an engine's venv that answers requests as JSON lines: the vLLM and OpenVINO GenAI
benches hold one per method (:mod:`selfspec.engines.vllm.bench`, :mod:`selfspec.engines.openvino.bench`).

The protocol the worker scripts speak (:mod:`selfspec.engines.vllm.vllm_worker`,
:mod:`selfspec.engines.openvino.openvino_worker`): after loading, one line ``{"ready": true, ...}``; then one reply
line per request line; ``{"error": TEXT}`` instead of a reply when it failed (it then exits); end of stdin ends it.

Idle workers are stopped. A bench interleaves its methods, so all but one worker wait at any time, and an engine's
idle threads are not always asleep: vLLM's CPU workers were measured spinning a core each between calls, which on a
2-core machine slows the method being timed. Each worker therefore runs in its own process group, stopped
(``SIGSTOP``) from the moment it is ready and continued (``SIGCONT``) only for its own requests and its close, so a
timed call shares the cores with nothing of the bench's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any


class EngineWorker:
    """One worker process, stopped between requests (the module docstring).

    Args:
        cmd: the command (the venv's interpreter, the worker script, its arguments).
        env: the worker's whole environment.
        log: the file its stderr (the engine's own logging) goes to; its end is quoted in errors.
        what: what loading it means, for errors (``"loading vLLM (plain)"``).

    Attributes:
        ready: the worker's ready line (``load_s`` and what else the worker reports).

    Raises:
        RuntimeError: the worker failed to load (its message, or its exit status, and the end of its log).
    """

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], log: Path, what: str) -> None:
        self.log = Path(log)
        with open(self.log, "w") as sink:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [str(c) for c in cmd],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=sink,
                text=True,
                env=dict(env),
                start_new_session=True,  # its own process group: stopped and continued with whatever it starts
            )
        self.ready = self._read(what)
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: signal.Signals) -> None:
        """Signal the worker's group; a stop is waited for (``waitpid(WUNTRACED)``: stopping is asynchronous, and the
        next timed call must not begin while the worker still runs)."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:  # exited between the poll and the signal
            return
        if sig == signal.SIGSTOP:
            try:
                _, status = os.waitpid(self.proc.pid, os.WUNTRACED)
            except ChildProcessError:  # reaped meanwhile
                return
            if not os.WIFSTOPPED(status):  # it exited instead: keep its status for Popen
                self.proc.returncode = os.waitstatus_to_exitcode(status)

    def _read(self, what: str) -> dict[str, Any]:
        stdout: IO[str] = self.proc.stdout  # type: ignore[assignment]
        line = stdout.readline()
        reply = json.loads(line) if line.strip() else {"error": f"the worker exited (status {self.proc.wait()})"}
        if "error" in reply:
            self.close()
            tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{what} failed: {reply['error']}\n--- end of its log ({self.log}) ---\n{tail}")
        return reply

    def request(self, message: Mapping[str, Any], what: str) -> dict[str, Any]:
        """Send one request and return its reply, the worker running only meanwhile.

        Raises:
            RuntimeError: the worker replied with an error or exited (``what`` names the call; the end of its log).
        """
        self._signal(signal.SIGCONT)
        try:
            stdin: IO[str] = self.proc.stdin  # type: ignore[assignment]
            stdin.write(json.dumps(dict(message)) + "\n")
            stdin.flush()
            return self._read(what)
        finally:
            self._signal(signal.SIGSTOP)

    def close(self) -> None:
        """End the worker: continue it, close its stdin (it exits), kill its group after 30 s."""
        self._signal(signal.SIGCONT)
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:  # it had exited already
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait()
