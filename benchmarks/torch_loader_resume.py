"""Is the torchvision loader deterministic for one seed: across loaders, across worker counts, and for a
loader that starts at epoch 1 (a resumed run) against one that went through epoch 0 first?"""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, ".")
from pipeline.data import open_source, write_folder
from pipeline.data.loaders import LoaderSpec, build_loader
from tests.test_data import IDENTITY

root = Path(sys.argv[1])
if not (root / "folder").exists():
    write_folder(open_source("synthetic:classes=48,count=48,size=24"), root / "folder", size=None, quality=95,
                 log=lambda _: None)

def epoch(loader, e):
    loader.next_epoch = e
    xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in loader])
    x, y = np.concatenate(xs), np.concatenate(ys)
    return x[np.argsort(y)], y

def spec(workers):
    return LoaderSpec(str(root / "folder"), train=True, batch_size=8, res=16, crop_scale=(0.2, 1.0), workers=workers,
                      seed=3, **IDENTITY)

def check(workers):
    """The three comparisons for one worker count; its epoch 0 images. The loaders are local, so that their worker
    processes shut down when this returns, not at a later garbage collection (in the test suite, which runs this in
    its process, that took 40 s inside whichever test came next)."""
    a = build_loader("torch", spec(workers))
    e0, o0 = epoch(a, 0)
    e1, o1 = epoch(a, 1)
    torch.rand(5)  # the model's draws between loaders
    b = build_loader("torch", spec(workers))
    f0, p0 = epoch(b, 0)
    c = build_loader("torch", spec(workers))
    g1, q1 = epoch(c, 1)  # a resumed run
    print(f"workers={workers}: epoch 0 same in two loaders: images {np.array_equal(e0, f0)}, "
          f"order {np.array_equal(o0, p0)}; epoch 1 resumed = epoch 1 continued: images {np.array_equal(e1, g1)}, "
          f"order {np.array_equal(o1, q1)}")
    return e0


images = {workers: check(workers) for workers in (0, 2)}
print("workers 0 vs 2, epoch 0 images equal:", np.array_equal(images[0], images[2]))
