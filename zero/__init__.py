"""ZeroOptimizer: ZeRO stages 0-3, bucketed overlapped reductions, CPU offload, sharded state."""

from pipezero.zero.config import ZeroConfig
from pipezero.zero.gathered import gathered
from pipezero.zero.optimizer import ELEMENTWISE_OPTIMIZERS, ZeroOptimizer

__all__ = ["ZeroOptimizer", "ZeroConfig", "ELEMENTWISE_OPTIMIZERS", "gathered"]
