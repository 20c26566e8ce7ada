"""Sequence parallelism, the grid's sequence axis: each rank holds a slice of every sequence
(batch.py), attention exchanges slices for heads all-to-all (comms.py, attention.py; Hugging
Face models through transformers' attention interface: hf_attention.py), the layers that do so
(layers.py) and the loss of a slice (loss.py)."""

from pipezero.pipe.sequence.attention import Ulysses, check_heads
from pipezero.pipe.sequence.batch import next_token_labels, shard_batch, shard_sequence, whole_positions
from pipezero.pipe.sequence.layers import SplitsSequence, split_sequence
from pipezero.pipe.sequence.loss import ShardMean, ShardSum, ShardsLoss, shard_loss

__all__ = ["ShardMean", "ShardSum", "ShardsLoss", "SplitsSequence", "Ulysses", "check_heads",
           "next_token_labels", "shard_batch", "shard_loss", "shard_sequence", "split_sequence", "whole_positions"]
