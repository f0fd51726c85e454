"""The served model: an MLflow pyfunc that takes images and answers with class names.

It carries what a client would otherwise need to know: the model's preprocessing (timm's evaluation
transform from the model's data config: resize, centre crop, interpolation, mean and std; grayscale and
RGBA made RGB) and the dataset's class names. One column, ``image``, takes per row:

- an encoded image (JPEG, PNG, WebP, ...), as bytes, or base64 in JSON;
- a uint8 array (H, W) or (H, W, C), C in 1, 3, 4 (any size: it is resized as a decoded image is);
- the normalised float tensor (3, H, W) at the model's input size, which earlier versions took;
- a list of encoded images, each one image: the form a tensor-style body (``{"inputs": ["<base64>", ...]}``,
  ``{"instances": [...]}``) reaches the model in, as one row holding the list.

Per image it returns the top-1 class (``index``, ``label``, ``probability``) and the ``top_k`` classes
(``params: {"top_k": 5}``). Input it cannot use raises ``BadInput`` (HTTP 400 from the scoring server), one
line naming the image and what was wrong; so do more images than ``ServeConfig.max_images`` (counted before
any is decoded) and an image over ``ServeConfig.max_pixels`` (read from its header before it is decoded).
This module imports neither the training code nor Ray.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from typing import Any

import mlflow
import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.protos.databricks_pb2 import BAD_REQUEST
from mlflow.types.schema import AnyType, Array, ColSpec, Object, ParamSchema, ParamSpec, Property, Schema
from PIL import Image, UnidentifiedImageError

from pipeline.config.serve import ServeConfig

BAD_INPUT = "bad input: "  # the prefix the scoring app (pipeline.serving.app) finds in a message to cut it to a line
TOP_K = 5


class BadInput(MlflowException):
    """An image or parameter the model cannot use; HTTP 400 in the scoring server."""

    def __init__(self, message: str) -> None:
        super().__init__(BAD_INPUT + message, error_code=BAD_REQUEST)


def _decoded(image: Any, index: int, max_pixels: int):
    """A PIL image in RGB from encoded bytes or a uint8 array of at most ``max_pixels`` pixels, else BadInput."""

    if isinstance(image, str):
        try:
            image = base64.b64decode(image, validate=True)
        except (binascii.Error, ValueError):
            raise BadInput(f"image {index}: a string that is not base64; send the file's bytes base64-encoded") \
                from None
    if isinstance(image, (bytes, bytearray)):
        return _decoded_file(bytes(image), index, max_pixels)
    array = np.asarray(image)
    if array.dtype.kind not in "iu" or not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (1, 3, 4))) \
            or array.size == 0:
        raise BadInput(f"image {index}: an array of shape {array.shape} and dtype {array.dtype}; send uint8 (H, W) "
                       "or (H, W, 3), an encoded image, or the normalised float (3, H, W) at the model's size")
    _check_pixels(array.shape[1], array.shape[0], index, max_pixels)
    if array.min() < 0 or array.max() > 255:
        raise BadInput(f"image {index}: pixel values from {array.min()} to {array.max()}; uint8 runs from 0 to 255")
    array = array.astype(np.uint8)
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[..., 0]
    return Image.fromarray(array).convert("RGB")


def _check_pixels(width: int, height: int, index: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise BadInput(f"image {index}: {width} x {height} pixels, over the cap of {max_pixels:,} per image; "
                       "send a smaller image (`pipeline serve --max-pixels` sets the cap)")


def _decoded_file(data: bytes, index: int, max_pixels: int):
    """An encoded image in RGB, its size checked from the header before its pixels are decoded."""

    try:
        with Image.open(io.BytesIO(data)) as opened:  # reads the header only
            _check_pixels(*opened.size, index, max_pixels)
            opened.load()
            return opened.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        # PIL refuses (or, under -W error, warns about) a declared size before this cap is checked.
        raise BadInput(f"image {index}: a decompression bomb ({err}); send at most {max_pixels:,} pixels per "
                       "image") from None
    except UnidentifiedImageError:
        raise BadInput(f"image {index}: not an image file ({len(data)} bytes); send JPEG, PNG or WebP") from None
    except (OSError, SyntaxError, ValueError) as err:  # truncated or corrupt data
        raise BadInput(f"image {index}: a broken image file ({err})") from None


class ImageClassifier(mlflow.pyfunc.PythonModel):
    """The pyfunc: ``artifacts["model"]`` is the pickled ``nn.Module``; ``model_config`` holds ``classes`` and
    timm's data config (``input_size``, ``interpolation``, ``mean``, ``std``, ``crop_pct``, ``crop_mode``).
    ``OnnxImageClassifier`` is the same classifier on the exported network; the two differ in ``load_context``,
    ``_pixels`` and ``_probabilities`` only."""

    def load_context(self, context) -> None:
        import torch
        from timm.data import create_transform

        self.model = torch.load(context.artifacts["model"], map_location="cpu", weights_only=False).eval()
        self._configure(context.model_config)
        config = {key: value for key, value in context.model_config.items() if key != "classes"}
        self.transform = create_transform(**config, is_training=False)

    def _configure(self, model_config: dict[str, Any]) -> None:
        self.classes: list[str] = list(model_config["classes"])
        self.size = tuple(model_config["input_size"])
        self.limits = ServeConfig()

    def set_limits(self, limits: ServeConfig) -> None:
        """The caps on what one request may ask (``pipeline serve`` sets its flags' here)."""
        self.limits = limits

    def _pixels(self, image) -> np.ndarray:
        """A decoded RGB image -> the model's (3, H, W) float32 input (timm's evaluation transform)."""
        return self.transform(image).numpy()

    def _probabilities(self, batch: np.ndarray) -> np.ndarray:
        """(B, 3, H, W) float32 inputs -> (B, classes) float32 class probabilities."""
        import torch

        with torch.no_grad():
            return self.model(torch.from_numpy(batch)).float().softmax(-1).numpy()

    def _input(self, image: Any, index: int) -> np.ndarray:
        if isinstance(image, (list, np.ndarray)) and np.asarray(image).dtype.kind == "f":
            array = np.asarray(image, dtype=np.float32)
            if array.shape != self.size:
                raise BadInput(f"image {index}: a float array of shape {array.shape}; a normalised tensor must be "
                               f"{self.size}, else send uint8 pixels or an encoded image")
            if not np.isfinite(array).all():
                raise BadInput(f"image {index}: the float tensor holds NaN or infinity")
            return array
        return self._pixels(_decoded(image, index, self.limits.max_pixels))

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        top_k = int((params or {}).get("top_k", TOP_K))
        if not 1 <= top_k <= len(self.classes):
            raise BadInput(f"top_k {top_k}: give 1 to {len(self.classes)} (the classes)")
        images = _column(model_input)
        if len(images) > self.limits.max_images:  # before any is decoded
            raise BadInput(f"{len(images)} images in one request, over the cap of {self.limits.max_images}; "
                           "split them over several requests (`pipeline serve --max-images` sets the cap)")
        probs = self._probabilities(np.stack([self._input(image, i) for i, image in enumerate(images)]))
        indices = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]  # ties: the lower class first
        rows = []
        for row, index in zip(probs.tolist(), indices.tolist()):
            ranked = [{"index": i, "label": self.classes[i], "probability": row[i]} for i in index]
            rows.append({**ranked[0], "top_k": ranked})
        return pd.DataFrame(rows, columns=["index", "label", "probability", "top_k"])


# PIL's filters by timm's interpolation names (``timm.data.transforms.str_to_interp_mode``).
_FILTERS = {"nearest": Image.NEAREST, "bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "box": Image.BOX,
            "hamming": Image.HAMMING, "lanczos": Image.LANCZOS}


def check_eval_transform(model_config: dict[str, Any]) -> None:
    """ValueError where ``eval_pixels`` does not do what timm's transform for this data config does: it covers the
    centre crop of a square input after resizing the shorter side (timm's default), at a known interpolation."""
    size = tuple(model_config["input_size"])
    if model_config.get("crop_mode", "center") != "center" or size[1] != size[2] \
            or model_config.get("interpolation", "bilinear") not in _FILTERS \
            or float(model_config.get("crop_pct", 0.875)) > 1:
        raise ValueError(f"the torch-free preprocessing takes square inputs, crop_mode center, crop_pct at most 1 "
                         f"(no padding) and one of {', '.join(_FILTERS)}; this model has input_size {size}, crop_mode "
                         f"{model_config.get('crop_mode')!r}, crop_pct {model_config.get('crop_pct')}, interpolation "
                         f"{model_config.get('interpolation')!r}")


def eval_pixels(image, model_config: dict[str, Any]) -> np.ndarray:
    """timm's evaluation transform in PIL and numpy, without torch: the shorter side resized to
    ``floor(size / crop_pct)`` (the longer in proportion, truncated, as torchvision does), the centre ``size`` x
    ``size`` crop (its corner rounded as torchvision rounds it), scaled to [0, 1] and normalised. RGB PIL image ->
    (3, size, size) float32. ``check_eval_transform`` says which data configs it covers."""
    size = int(model_config["input_size"][-1])
    scale = math.floor(size / float(model_config.get("crop_pct", 0.875)))
    width, height = image.size
    if width <= height:
        target = (scale, int(scale * height / width))
    else:
        target = (int(scale * width / height), scale)
    if target != image.size:
        image = image.resize(target, _FILTERS[model_config.get("interpolation", "bilinear")])
    top, left = int(round((target[1] - size) / 2.0)), int(round((target[0] - size) / 2.0))
    pixels = np.asarray(image, dtype=np.float32)[top:top + size, left:left + size] / 255.0
    mean = np.asarray(model_config["mean"], dtype=np.float32)
    std = np.asarray(model_config["std"], dtype=np.float32)
    return ((pixels - mean) / std).transpose(2, 0, 1).copy()


class OnnxImageClassifier(ImageClassifier):
    """The classifier on the exported network (``pipeline.export``): ``artifacts["onnx"]`` is the ONNX file, run in
    ONNX Runtime; decoding and preprocessing in PIL and numpy (``eval_pixels``). Nothing here imports torch."""

    def load_context(self, context) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(context.artifacts["onnx"], providers=["CPUExecutionProvider"])
        self._configure(context.model_config)
        self.model_config = dict(context.model_config)

    def _pixels(self, image) -> np.ndarray:
        return eval_pixels(image, self.model_config)

    def _probabilities(self, batch: np.ndarray) -> np.ndarray:
        logits = self.session.run(None, {"images": batch.astype(np.float32, copy=False)})[0].astype(np.float64)
        exp = np.exp(logits - logits.max(-1, keepdims=True))
        return (exp / exp.sum(-1, keepdims=True)).astype(np.float32)


def _encoded_list(cell: Any) -> bool:
    """Whether a cell is a non-empty 1-D list of encoded images (base64 strings or bytes), never one image."""
    if not isinstance(cell, (list, tuple)) and not (isinstance(cell, np.ndarray) and cell.ndim == 1):
        return False
    return len(cell) > 0 and all(isinstance(item, (str, bytes, bytearray)) for item in cell)


def _column(model_input: Any) -> list[Any]:
    """The images of a request: the ``image`` column of a DataFrame, or a list / array of images; a cell that is
    a list of encoded images gives each of them (MLflow puts ``{"inputs": [STRING, ...]}`` in one cell)."""
    if isinstance(model_input, pd.DataFrame):
        if "image" not in model_input.columns:
            raise BadInput(f"no 'image' column (got {list(model_input.columns)}); send "
                           '{"dataframe_split": {"columns": ["image"], "data": [[IMAGE], ...]}}')
        images = list(model_input["image"])
    elif isinstance(model_input, dict) and "image" in model_input:
        images = list(model_input["image"])
    elif isinstance(model_input, (list, np.ndarray)):
        images = list(model_input)
    else:
        raise BadInput(f"{type(model_input).__name__} input; send a column 'image' of images")
    images = [image for cell in images for image in (cell if _encoded_list(cell) else [cell])]
    if not images:
        raise BadInput("no images; send at least one")
    return images


def signature_and_example(example_image: bytes, num_classes: int):
    """The signature (a column ``image`` of any of the forms above, the ``top_k`` parameter, the answer's
    columns) and an input example: ``example_image``, an encoded image, base64 in JSON."""

    ranked = Object([Property("index", "long"), Property("label", "string"), Property("probability", "double")])
    signature = ModelSignature(
        inputs=Schema([ColSpec(AnyType(), "image")]),
        outputs=Schema([ColSpec("long", "index"), ColSpec("string", "label"), ColSpec("double", "probability"),
                        ColSpec(Array(ranked), "top_k")]),
        params=ParamSchema([ParamSpec("top_k", "long", min(TOP_K, num_classes))]),
    )
    example = pd.DataFrame({"image": [base64.b64encode(example_image).decode()]})
    return signature, (example, {"top_k": min(TOP_K, num_classes)})


def encode_jpeg(array: np.ndarray, quality: int = 95) -> bytes:
    """``(H, W, 3)`` uint8 -> JPEG bytes."""

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()
