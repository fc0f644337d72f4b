"""Sharded execution of Strata's engine: tensor and pipeline parallel ranks that step together (docs/sharding.md).

plan.py      which part of the model a rank holds (`ShardPlan`), and the check that a size divides the model
comm.py      the gloo (CPU) or NCCL (CUDA) groups of one sharded worker, and the collectives the forward uses
wire.py      the typed messages between the driver (rank 0) and the other ranks
stage.py     one rank's part of a step: its pipeline stage over each micro-batch
group.py     the driver's side of the group: rank processes, heartbeats, failure, a new generation on demand
executor.py  the engine core's `ModelExecutor` over a group (its failure events, restarts with backoff) and
             `KVConnector` over every rank's tiers
rank.py      the process of every rank but 0
"""
