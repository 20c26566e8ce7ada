"""What the other packages share: p2p activations, bucketed collectives, traffic (and, re-exported, the optimizer chain)."""

from pipezero.chain import ChainLink, ChainWrapper, innermost, links  # re-exported: the chain lives at the root
from pipezero.comm.buckets import DEFAULT_BUCKET_BYTES, all_reduce_coalesced, plan_buckets
from pipezero.comm.collectives import Handle, all_gather, all_reduce, group_size, reduce_scatter
from pipezero.comm.nvtx import nvtx_range, profiling, profiling_enabled
from pipezero.comm.p2p import P2P, CommTimeout, PeerLost, is_peer_lost, peer_lost
from pipezero.comm.partial_grad import mark_partial_grad, partial_grad_group
from pipezero.comm.replica import is_replica, mark_replica
from pipezero.comm.tensor_shard import TensorShard, mark_tensor_shard, slice_of_whole, tensor_shard, whole_of_shard
from pipezero.comm.traffic import TRAFFIC, Traffic

__all__ = [
    "P2P", "CommTimeout", "PeerLost", "is_peer_lost", "peer_lost", "Handle", "TRAFFIC", "Traffic", "DEFAULT_BUCKET_BYTES",
    "all_reduce", "reduce_scatter", "all_gather", "group_size",
    "all_reduce_coalesced", "plan_buckets",
    "nvtx_range", "profiling", "profiling_enabled", "ChainLink", "ChainWrapper", "innermost", "links",
    "mark_replica", "is_replica", "TensorShard", "mark_tensor_shard", "tensor_shard", "whole_of_shard",
    "slice_of_whole", "mark_partial_grad", "partial_grad_group",
]
