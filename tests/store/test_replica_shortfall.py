"""Puts that ask for more replicas than the pool has holders (one of two
holders down or suspect, a pool of one): each is stored with the replicas
the holders can give, and none of them evicts what is already stored. A
chaos run caught the master evicting the previous put's object for the
replica no segment could take, so that of four puts after a master restart
only the last one was readable."""

from __future__ import annotations

from collections.abc import Callable

from kvpool.cluster.processes import MasterProcess, NodeDaemonProcess
from kvpool.store import Client, ReplicateConfig


def test_puts_asking_more_replicas_than_holders_keep_every_object(
        master: MasterProcess, make_client: Callable[..., Client],
        key: Callable[[str], str]) -> None:
    with NodeDaemonProcess(master.address, "16MiB", host_id="only-holder") as holder:
        (seg,) = holder.segment_ids
        writer = make_client(host_id="writer-host")
        cfg = ReplicateConfig(replica_num=2)
        ks = [key(f"two/{i}") for i in range(24)]
        values = {k: bytes([i]) * 32768 for i, k in enumerate(ks)}
        for k in ks:
            writer.put(k, values[k], cfg)
        reader = make_client(host_id="reader-host")
        for k in ks:  # every one, not only the last
            assert reader.get(k) == values[k], k
            assert reader.replica_segments(k) == [seg]
