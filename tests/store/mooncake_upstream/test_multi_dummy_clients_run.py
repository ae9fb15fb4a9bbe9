"""Mooncake's ``test_multi_dummy_clients.py`` as its script runs it: two
engine processes (``--client-id client1`` and ``client2``), each a standalone
store beside the node daemon on 127.0.0.1:50052 (conftest.py), handing keys
to each other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("test_multi_dummy_clients.py")


def test_two_standalone_engines_exchange_keys(mooncake_env: dict[str, str]) -> None:
    env = dict(os.environ, **mooncake_env)
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), "--client-id", cid],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env)
             for cid in ("client1", "client2")]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=60)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
        assert "Ran 1 test" in out and "OK" in out, out[-3000:]
