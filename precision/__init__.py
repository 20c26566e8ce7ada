"""precision/: loss scaling (static, dynamic), fp32 master weights, global grad norm/overflow/clipping,
casting a model's parameters (not its buffers) to the training dtype."""

from pipezero.chain import ChainLink
from pipezero.precision.cast import cast_parameters
from pipezero.precision.clip import clip_grad_norm, global_grad_norm
from pipezero.precision.config import Precision, ScalerConfig, read_precision
from pipezero.precision.master import MasterWeights
from pipezero.precision.scaler import LossScaler

__all__ = ["LossScaler", "MasterWeights", "ScalerConfig", "ChainLink", "cast_parameters", "clip_grad_norm",
           "global_grad_norm"]
