"""Communication the other packages share: p2p activations, bucketed collectives, traffic."""

from pipezero.comm.buckets import (DEFAULT_BUCKET_BYTES, all_gather_coalesced, all_reduce_coalesced,
                                   plan_buckets, reduce_scatter_coalesced)
from pipezero.comm.collectives import Handle, all_gather, all_reduce, group_size, reduce_scatter
from pipezero.comm.nvtx import nvtx_range, profiling, profiling_enabled
from pipezero.comm.p2p import P2P, CommTimeout, PeerLost, is_peer_lost, peer_lost
from pipezero.comm.traffic import TRAFFIC, Traffic

__all__ = [
    "P2P", "CommTimeout", "PeerLost", "is_peer_lost", "peer_lost", "Handle", "TRAFFIC", "Traffic", "DEFAULT_BUCKET_BYTES",
    "all_reduce", "reduce_scatter", "all_gather", "group_size",
    "all_reduce_coalesced", "reduce_scatter_coalesced", "all_gather_coalesced", "plan_buckets",
    "nvtx_range", "profiling", "profiling_enabled",
]
