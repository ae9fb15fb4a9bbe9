"""kvpool.master.ha: a master group on etcd (docs/ha.md).

- :mod:`.election`: one leader per cluster id (etcd lease + campaign key),
  its epoch, the fencing deadline, the in-sync standby set.
- :mod:`.replication`: the stream the leader ships committed journal
  batches to hot standbys on (messages, log positions, epoch history);
  :mod:`.source` the leader's end (releases replies once the in-sync
  standbys hold them), :mod:`.sink` a standby's (writes, acks, applies to
  its own directory and journal), :mod:`.transport` the socket or ZeroMQ
  under both.
- :mod:`.in_sync`: the leader's in-sync set, published in etcd.
- :mod:`.node`: one instance of the group wired into the master's loop.
"""

__all__: list[str] = []
