"""Train the small GPT with a pipeline, ZeRO and mixed precision: the main job, pipezero/train/gpt/job.py.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py            # pipe 2 x data 2, CPU or GPU
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --schedule zbv --zero-stage 1
    torchrun --standalone --nproc-per-node 8 examples/train_gpt.py --pipe 2 --data 2 --tensor 2   # 3D
    sbatch examples/slurm/train_gpt.sbatch                                    # Slurm, one agent per node
    tensorboard --logdir runs/gpt

The job reads top to bottom in the package (it ships in the wheel, so `pipezero train` runs it
too); this script is the same command from a clone. `import train_gpt` gives its `main` and
`parse_args`.
"""

from pipezero.train.gpt.job import main, parse_args, run

__all__ = ["main", "parse_args", "run"]

if __name__ == "__main__":
    run()
