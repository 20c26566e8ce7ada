"""train/: thin glue: ds_config.json -> the explicit parts, checkpoints by global name, the CLI.

    parts = build("ds_config.json", specs=gpt_specs(cfg), loss_fn=gpt_loss)   # grid, module, chain, runner
    engine, optimizer, _, scheduler = initialize(model=model, config="ds_config.json")  # DeepSpeed-shaped
    save_state(parts, "ckpt", step, data.state_dict()); load_state(parts, "ckpt")  # any grid to any grid
    save_state(HandParts(model, opt, sched), "ckpt", step)   # a job composed by hand, ZeRO or not

The names below import their modules on first use (pipezero/lazy.py): the command line's modules
live here too, and `pipezero --help` must not wait for torch.
"""

from pipezero.lazy import lazy_package

_FROM = {
    "pipezero.pipe.schedule.registry": ["make_schedule"],
    "pipezero.train.build": ["Parts", "build", "init_process_group"],
    "pipezero.train.checkpoint": ["CheckpointError", "export_consolidated", "load_checkpoint", "save_checkpoint"],
    "pipezero.train.config": ["ConfigError", "TrainConfig", "parse_config"],
    "pipezero.train.config.optim": ["build_optimizer", "build_scheduler"],
    "pipezero.train.data": ["ShardedBatches", "TokenData"],
    "pipezero.train.initialize": ["Engine", "initialize"],
    "pipezero.train.log": ["Phase", "Progress", "TensorBoardWriter", "Timers", "get_logger"],
    "pipezero.train.checkpoint.state": ["export_model", "load_state", "resume_if_any", "save_state"],
    "pipezero.train.checkpoint.state_parts": ["HandParts"],
}

__all__ = ["CheckpointError", "ConfigError", "Engine", "HandParts", "Parts", "Phase", "Progress", "ShardedBatches",
           "TensorBoardWriter", "Timers", "TokenData", "TrainConfig", "build", "build_optimizer",
           "build_scheduler", "export_consolidated", "export_model", "get_logger", "init_process_group",
           "initialize", "load_checkpoint", "load_state", "make_schedule", "parse_config", "resume_if_any",
           "save_checkpoint", "save_state"]

lazy_package(__name__, {name: module for module, names in _FROM.items() for name in names})
