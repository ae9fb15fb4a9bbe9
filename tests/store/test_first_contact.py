"""A client's first request to a holder on another host: the holder's memory
segment descriptor (as the master hands it out) publishes the holder's bulk
port, so the very first put and get go over the bulk socket; none of it waits
for a ZeroMQ round trip that asks for the port (15-48 ms per new pair of
processes across hosts before)."""

from __future__ import annotations

from collections.abc import Callable

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
from kvpool.store import Client, ReplicateConfig
from kvpool.transfer import wire


def test_first_put_and_get_take_the_published_bulk_port(
        master: MasterProcess, make_client: Callable[..., Client],
        key: Callable[[str], str]) -> None:
    with NodeDaemonProcess(master.address, "16MiB", host_id="holder-host") as holder:
        (seg,) = holder.segment_ids
        reader = make_client(host_id="reader-host")  # another host: tcp, not shm
        tcp = reader.engine.transport("tcp")
        assert tcp.stats()["bulk_requests"] == 0
        value = bytes(range(256)) * 16  # 4 KiB
        k = key("first")
        reader.put(k, value, ReplicateConfig(preferred_segments=[seg]))
        desc = reader.describe_segment(seg)
        assert desc is not None and desc.host_id == "holder-host"
        offer = wire.bulk_hint(desc.extra)
        assert offer is not None and offer.bulk > 0
        assert tcp.stats()["bulk_requests"] == 1  # the first write: the bulk socket
        assert reader.get(k) == value
        assert tcp.stats()["bulk_requests"] == 2
        assert not tcp._socks  # no ZeroMQ socket was ever opened (data or BULK query)
        # a second reader, first contact through a read: the same
        other = make_client(host_id="other-host")
        buf = bytearray(len(value))
        assert other.batch_get_into([k], [buf]) == [len(value)]
        assert bytes(buf) == value
        assert other.engine.transport("tcp").stats()["bulk_requests"] == 1
        assert not other.engine.transport("tcp")._socks
