import ctypes, json, sys
if sys.argv[2] == "mallopt":
    libc = ctypes.CDLL("libc.so.6")
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    assert libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20) == 1
    assert libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1   # int argument
    assert libc.mallopt(M_TOP_PAD, 64 * 2**20) == 1
import torch
from pipeline.bench.paired import SpeedSettings
from pipeline.evaluate import speed
from pipeline.train.checkpoint import model_from_checkpoint
path = sys.argv[1]
model, config, _ = model_from_checkpoint(path)
reference, _, _ = model_from_checkpoint(path, plain=True)
if sys.argv[2] == "late":
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 32 * 2**20); libc.mallopt(-1, 2**31 - 1); libc.mallopt(-2, 64 * 2**20)
images = torch.randn(64, 3, *model.patch_embed.img_size)
r = speed(model, reference, images, device=torch.device("cpu"), dtype="fp32", threads=1,
          settings=SpeedSettings(tolerance=0.02, cap_s=4.0, warmup=1))
print(json.dumps({"ratio": round(r.ratio, 4), "low": round(r.low, 4), "high": round(r.high, 4), "blocks": r.blocks}))
