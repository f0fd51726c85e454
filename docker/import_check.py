"""Imports, inside an image, every module of `pipeline` (a superset of what the Ray workers load: the
training loop, the stages, the loaders, the methods, serving) and the compiled code under them, then
loads the clustering kernels that the build stage compiled. Exits non-zero on the first failure.

    podman run --rm -i IMAGE python - < docker/import_check.py
"""

import importlib
import pkgutil

import pipeline

# __main__ modules run their command when imported
modules = sorted(m.name for m in pkgutil.walk_packages(pipeline.__path__, "pipeline.")
                 if not m.name.endswith("__main__"))
for name in modules:
    importlib.import_module(name)
# What the workers reach only through calls: FFCV's decoders (libturbojpeg, OpenCV), cv2, Ray Train/Tune.
# The ONNX export's translator and runtime (`pipeline export`), which pipeline.export imports only when called.
for name in ("ffcv.fields.rgb_image", "ffcv.fields.decoders", "ffcv.transforms", "cv2", "ray.train.torch",
             "ray.tune", "mlflow", "timm", "onnx", "onnxscript", "onnxruntime"):
    importlib.import_module(name)

import torch  # noqa: E402

from pipeline.pooling import native  # noqa: E402

assert native.library() is not None, "the clustering CPU kernels are not in the image (PIPELINE_NATIVE_CACHE)"
print(f"imported {len(modules)} pipeline modules, ffcv, cv2, ray.train, ray.tune, mlflow, timm, onnx, onnxruntime; "
      f"native kernels {native.library_path()}; torch {torch.__version__} (CUDA {torch.version.cuda})")
