"""The engines' worker processes (selfspec.engines.worker): JSON lines, and stopped while idle, so a worker
whose engine spins between calls takes no CPU from the method being timed."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from selfspec.engines.worker import EngineWorker

# A worker whose idle thread spins, as vLLM's CPU workers were seen to: it burns CPU unless it is stopped.
SPINNING = """
import json, sys, threading
def spin():
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
print(json.dumps({"ready": True, "load_s": 0.0}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    if request.get("fail"):
        print("the engine's traceback", file=sys.stderr, flush=True)
        print(json.dumps({"error": "ValueError: bad request"}), flush=True)
        sys.exit(1)
    print(json.dumps({"echo": request["n"] * 2}), flush=True)
"""


def _state_and_cpu_ticks(pid: int) -> tuple[str, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return fields[0], int(fields[11]) + int(fields[12])  # state, utime + stime


@pytest.fixture
def worker(tmp_path):
    script = tmp_path / "spinning_worker.py"
    script.write_text(SPINNING)
    w = EngineWorker([sys.executable, str(script)], {"PATH": "/usr/bin:/bin"}, tmp_path / "w.log", "loading it")
    yield w
    w.close()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_an_idle_worker_is_stopped_and_takes_no_cpu(worker):
    assert worker.request({"n": 21}, "a call") == {"echo": 42}
    state, before = _state_and_cpu_ticks(worker.proc.pid)
    time.sleep(0.5)  # its spinning thread would take ~50 ticks of CPU here if it ran
    after = _state_and_cpu_ticks(worker.proc.pid)[1]
    assert state == "T" and after == before
    assert worker.request({"n": 2}, "a call") == {"echo": 4}  # continued for its request, and answers


def test_a_worker_error_raises_with_its_message_and_log_and_ends_it(worker):
    with pytest.raises(RuntimeError, match=r"(?s)a call failed: ValueError: bad request.*the engine's traceback"):
        worker.request({"fail": True}, "a call")
    assert worker.proc.poll() is not None


def test_a_worker_that_exits_while_loading_raises_with_its_status(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text("import sys\nprint('cannot load the model', file=sys.stderr)\nsys.exit(3)\n")
    with pytest.raises(RuntimeError, match=r"(?s)loading it failed: the worker exited \(status 3\).*cannot load"):
        EngineWorker([sys.executable, str(script)], {"PATH": "/usr/bin:/bin"}, tmp_path / "w.log", "loading it")


def test_close_ends_a_stopped_worker(worker):
    worker.close()
    assert worker.proc.returncode == 0
