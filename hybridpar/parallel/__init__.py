"""Parallelism: the device mesh, partitioning rules, the sharded head,
collectives and gradient buckets, and joining processes."""
