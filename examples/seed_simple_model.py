"""The seed's example, ported: a 784-512-256-10 MLP with the seed's ds_config, on real digits.

    python examples/seed_simple_model.py                       # one process
    torchrun --standalone --nproc-per-node 2 examples/seed_simple_model.py   # ZeRO-3 over 2 ranks

The config (examples/configs/seed_ds_config.json) is used verbatim: ZeRO-3 with CPU offload,
fp16 with dynamic loss scaling, train_batch_size 32. The loop is the DeepSpeed one with
`deepspeed.initialize` replaced by `pipezero.train.initialize` (README: before/after).
Digits: scikit-learn's 8x8 digits upscaled to 28x28 (pip install scikit-learn), or MNIST IDX
files from --mnist DIR (train-images-idx3-ubyte, train-labels-idx1-ubyte).
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipezero.train import initialize
from pipezero.train.log import get_logger

CONFIG = Path(__file__).resolve().parent / "configs" / "seed_ds_config.json"


class SimpleModel(nn.Module):
    """The seed's MLP: 784 -> 512 -> 256 -> 10."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(784, 512), nn.Linear(512, 256), nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def load_digits(mnist: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(images [N, 784] float in [0, 1], labels [N]) from MNIST IDX files or scikit-learn's digits."""
    if mnist:
        return _read_idx(Path(mnist))
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError:
        raise SystemExit("no digits to train on: pip install scikit-learn (its 8x8 digits ship inside the "
                         "package), or pass --mnist DIR with MNIST's IDX files") from None
    digits = sk_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0          # [N, 1, 8, 8]
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    return images.flatten(1), torch.tensor(digits.target, dtype=torch.int64)


def _read_idx(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST's IDX files, each checked against its header (magic, dims, length) and the two against each
    other, before training: a bad file ends in one line naming it."""
    images_path, images = _idx_file(folder, "train-images-idx3-ubyte", 0x803)
    labels_path, labels = _idx_file(folder, "train-labels-idx1-ubyte", 0x801)
    if images.shape[1:] != (28, 28):
        raise SystemExit(f"--mnist {images_path}: images of {images.shape[1]}x{images.shape[2]} pixels; the seed's "
                         "MLP takes MNIST's 28x28")
    if len(images) != len(labels):
        raise SystemExit(f"--mnist {folder}: {labels_path.name} holds {len(labels)} labels but {images_path.name} "
                         f"{len(images)} images; use the train images and train labels of one download")
    if len(labels) and int(labels.max()) > 9:
        raise SystemExit(f"--mnist {labels_path}: labels up to {int(labels.max())}; MNIST's digits are 0..9")
    return images.reshape(-1, 784).float() / 255.0, labels.long()


def _idx_file(folder: Path, name: str, magic: int) -> tuple[Path, torch.Tensor]:
    """(path, uint8 tensor of the header's dims) of `name` or `name`.gz in folder."""
    for path in (folder / name, folder / f"{name}.gz"):
        if path.is_file():
            break
    else:
        raise SystemExit(f"--mnist {folder}: no {name} (or {name}.gz) there")
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as err:
            raise SystemExit(f"--mnist {path}: not a whole gzip file ({err}); download it again") from None
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    found = int.from_bytes(data[:4], "big") if len(data) >= 4 else None
    if found != magic:
        raise SystemExit(f"--mnist {path}: IDX magic {found if found is None else hex(found)}, expected {hex(magic)} "
                         f"({'images' if ndim == 3 else 'labels'}, {ndim}-D uint8); is it the other file, or not IDX?")
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    want = header + int(torch.tensor(dims).prod())
    if len(data) != want:
        raise SystemExit(f"--mnist {path}: {len(data)} bytes, but its header ({' x '.join(map(str, dims))}) makes "
                         f"{want}; the file is truncated or damaged: download it again")
    return path, torch.frombuffer(bytearray(data[header:]), dtype=torch.uint8).view(*dims)


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mnist", default=None, help="folder with MNIST IDX files (default: scikit-learn digits)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--config", default=str(CONFIG))
    args = p.parse_args(argv)
    log = get_logger("seed")

    images, labels = load_digits(args.mnist)
    model = SimpleModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, optimizer, _, _ = initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer,
                                         config=args.config)
    grid, batch = engine.parts.grid, engine.parts.config.batch
    gen = torch.Generator().manual_seed(0)
    loss = torch.tensor(float("nan"))
    for step in range(args.steps):
        index = torch.randint(0, len(labels), (batch.train_batch_size,), generator=gen)
        mine = index.view(batch.data_degree, -1)[grid.data_rank]  # this data rank's share of the batch
        outputs = engine(images[mine].to(engine.dtype))
        loss = F.cross_entropy(outputs.float(), labels[mine])
        engine.backward(loss)
        engine.step()
        if step % 50 == 0 or step == args.steps - 1:
            with torch.no_grad(), optimizer.gathered_parameters():
                accuracy = (engine(images.to(engine.dtype)).argmax(-1) == labels).float().mean().item()
            log.info("step %d loss %.4f accuracy %.3f loss scale %g", step, loss.item(), accuracy,
                     engine.parts.scaler.loss_scale)
    return loss.item()


if __name__ == "__main__":
    main()
