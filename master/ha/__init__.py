"""kvpool.master.ha: a master group on etcd (docs/ha.md).

- :mod:`.election`: one leader per cluster id (etcd lease + campaign key),
  its epoch, the fencing deadline, the in-sync standby set.
- :mod:`.replication`: the leader ships committed journal batches to hot
  standbys over ZeroMQ and releases replies once the in-sync standbys hold
  them; standbys apply them to their own directory and journal.
"""

__all__: list[str] = []
