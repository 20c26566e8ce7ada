"""ds_config.json -> the validated parts of a training job: the top level (parse.py, keys.py), the batch
arithmetic (batch.py), Hugging Face's "auto" values (auto.py), the compile, optimizer and scheduler
sections (compile.py, optim.py). Each package's own section is read by that package.

`pipezero.train.config` was one module before it was this folder: its names are here as they were.
"""

from pipezero.train.config.parse import (BatchConfig, ConfigError, ConfigTypeError, PipelineConfig,
                                         TensorBoardConfig, TrainConfig, parse_config)

__all__ = ["BatchConfig", "ConfigError", "ConfigTypeError", "PipelineConfig", "TensorBoardConfig", "TrainConfig",
           "parse_config"]
