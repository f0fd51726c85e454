"""One fresh process: a demo checkpoint against its own plain model, as the evaluate stage times it."""
import json, sys, time
import torch
from pipeline.bench.paired import SpeedSettings
from pipeline.evaluate import speed
from pipeline.train.checkpoint import model_from_checkpoint
path = sys.argv[1]
model, config, _ = model_from_checkpoint(path)
reference, _, _ = model_from_checkpoint(path, plain=True)
model.eval(); reference.eval()
images = torch.randn(64, 3, *model.patch_embed.img_size)
r = speed(model, reference, images, device=torch.device("cpu"), dtype="fp32", threads=1,
          settings=SpeedSettings(tolerance=0.02, cap_s=4.0, warmup=1))
print(json.dumps({"ratio": r.ratio, "low": r.low, "high": r.high, "blocks": r.blocks}))
