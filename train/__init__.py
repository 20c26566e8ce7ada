"""train/: thin glue: ds_config.json -> the explicit parts, checkpoints by global name, the CLI.

    parts = build("ds_config.json", specs=gpt_specs(cfg), loss_fn=gpt_loss)   # grid, module, chain, runner
    engine, optimizer, _, scheduler = initialize(model=model, config="ds_config.json")  # DeepSpeed-shaped
    save_state(parts, "ckpt", step, data.state_dict()); load_state(parts, "ckpt")  # any grid to any grid
    save_state(HandParts(model, opt, sched), "ckpt", step)   # a job composed by hand, ZeRO or not
"""

from pipezero.pipe.schedule.registry import make_schedule
from pipezero.train.build import Parts, build, init_process_group
from pipezero.train.checkpoint import CheckpointError, export_consolidated, load_checkpoint, save_checkpoint
from pipezero.train.config import ConfigError, TrainConfig, parse_config
from pipezero.train.config.optim import build_optimizer, build_scheduler
from pipezero.train.data import ShardedBatches, TokenData
from pipezero.train.initialize import Engine, initialize
from pipezero.train.log import Phase, Progress, TensorBoardWriter, Timers, get_logger
from pipezero.train.checkpoint.state import export_model, load_state, resume_if_any, save_state
from pipezero.train.checkpoint.state_parts import HandParts

__all__ = ["CheckpointError", "ConfigError", "Engine", "HandParts", "Parts", "Phase", "Progress", "ShardedBatches",
           "TensorBoardWriter", "Timers", "TokenData", "TrainConfig", "build", "build_optimizer",
           "build_scheduler", "export_consolidated", "export_model", "get_logger", "init_process_group",
           "initialize", "load_checkpoint", "load_state", "make_schedule", "parse_config", "resume_if_any",
           "save_checkpoint", "save_state"]
