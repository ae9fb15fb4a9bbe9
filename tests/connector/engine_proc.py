"""Drive ``vllm_runner.py`` (a vLLM engine in a subprocess) from tests and benchmarks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path
from typing import Any

__all__ = ["EngineProc", "kv_transfer_config"]

RUNNER = Path(__file__).with_name("vllm_runner.py")
MARK = "@@KVPOOL@@ "


def kv_transfer_config(master_address: str, **extra: Any) -> dict[str, Any]:
    """The kv_transfer_config loading KVPoolConnector against ``master_address``."""
    return {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.connector.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"master_address": master_address, **extra},
    }


class EngineProc:
    """A vLLM engine subprocess; ``generate`` sends one command and returns its reply.

    Output that is not a reply (vLLM's logs) is kept in a bounded tail for
    error messages. Use as a context manager (quits, then kills after a timeout).
    """

    def __init__(self, config: dict[str, Any], python: str | None = None,
                 start_timeout_s: float = 120.0) -> None:
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                    "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"})
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [python or sys.executable, str(RUNNER), json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
            text=True, bufsize=1,
        )
        self._replies: deque[dict[str, Any]] = deque()
        self._cv = threading.Condition()
        self._tail: deque[str] = deque(maxlen=200)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._wait_reply(start_timeout_s)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                with self._cv:
                    self._replies.append(json.loads(line[len(MARK):]))
                    self._cv.notify_all()
            else:
                self._tail.append(line)
        with self._cv:
            self._cv.notify_all()

    def log_tail(self) -> str:
        self._log.seek(0)
        err = self._log.read().decode(errors="replace")[-6000:]
        return "".join(self._tail)[-3000:] + "\n--- stderr ---\n" + err

    def _wait_reply(self, timeout: float) -> dict[str, Any]:
        with self._cv:
            ok = self._cv.wait_for(lambda: self._replies or self.proc.poll() is not None,
                                   timeout=timeout)
            if self._replies:
                return self._replies.popleft()
        raise RuntimeError(
            f"vLLM runner {'timed out' if not ok else 'exited'} "
            f"(rc={self.proc.poll()}):\n{self.log_tail()}"
        )

    def generate(self, prompts: list[str], max_tokens: int = 8, ttft: bool = False,
                 timeout: float = 120.0) -> dict[str, Any]:
        """Greedy-generate ``prompts`` one by one; returns ``{"results": [...],
        "connector": {...}}`` (see vllm_runner)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens,
                                          "ttft": ttft}) + "\n")
        self.proc.stdin.flush()
        return self._wait_reply(timeout)

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> EngineProc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
