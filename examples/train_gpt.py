"""Train the small GPT with a pipeline, ZeRO and mixed precision: the main job, pipezero/train/gpt/job.py.

    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py            # pipe 2 x data 2, CPU or GPU
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --schedule zbv --zero-stage 1
    torchrun --standalone --nproc-per-node 8 examples/train_gpt.py --pipe 2 --data 2 --tensor 2   # 3D
    sbatch examples/slurm/train_gpt.sbatch                                    # Slurm, one agent per node
    tensorboard --logdir runs/gpt

The job reads top to bottom in the package (it ships in the wheel, so `pipezero train` runs it
too); this script is the same command from a clone, and `import train_gpt` (examples/ on
sys.path) is that module itself.
"""

import sys

from pipezero.train.gpt import job as _job

if __name__ == "__main__":
    _job.run()
else:  # the package's module under this name too: one set of functions (tests read and patch them)
    sys.modules[__name__] = _job
