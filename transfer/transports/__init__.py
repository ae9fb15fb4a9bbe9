"""Transport implementations (shm, tcp, posix, gds, rdma)."""
