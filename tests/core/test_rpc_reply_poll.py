"""The master stub's reply poll on the direct socket (kvpool.core.rpc_client):
it polls only while replies of that kind have of late come within its window,
and every path (poll, block at once, no poll) gives the same answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.cluster.processes import MasterProcess
from kvpool.core.protocol import BatchExist, Exist, ExistReply

pytestmark = pytest.mark.timeout(60)


def test_reply_poll_follows_the_reply_wait(tmp_path: Path) -> None:
    with MasterProcess(data_dir=str(tmp_path / "d")) as m, m.client(timeout_s=5) as c:
        c.call(Exist(key="a"))
        for _ in range(20):
            assert c.call(Exist(key="a")) == ExistReply(exists=False)
        assert c.local
        one_key, other = c._reply_wait[1], c._reply_wait[0]
        assert 0.0 < one_key < 1.0  # one-key replies measured ...
        assert other == 0.0  # ... apart from the rest
        assert c.call(BatchExist(keys=["a", "b"])).exists == [False, False]
        assert c._reply_wait[0] > 0.0
        # replies that came late of late: the caller blocks at once, same answer,
        # and the average moves back towards what the reply took now
        c._reply_wait[1] = 1.0
        assert c.call(Exist(key="a")) == ExistReply(exists=False)
        assert c._reply_wait[1] < 1.0
        # no poll at all: nothing measured
        c.spin_s = 0.0
        before = list(c._reply_wait)
        assert c.call(Exist(key="a")) == ExistReply(exists=False)
        assert c.call(BatchExist(keys=["a"])).exists == [False]
        assert c._reply_wait == before


def test_poll_windows_are_settings() -> None:
    from kvpool.core.config import ConfigError, load_dataclass
    from kvpool.core.rpc_client import MasterClient, RpcPollConfig

    cfg = load_dataclass(RpcPollConfig, {"spin_us": 0, "spin_small_us": "70"})
    with MasterClient("127.0.0.1:1", poll=cfg) as c, MasterClient("127.0.0.1:1") as d:
        assert (c.spin_s, c.spin_small_s) == (0.0, 70e-6)
        assert (d.spin_s, d.spin_small_s) == (50e-6, 150e-6)  # RpcPollConfig's defaults
    with pytest.raises(ConfigError):
        load_dataclass(RpcPollConfig, {"spin_us": -1})
