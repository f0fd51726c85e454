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
    timm's data config (``input_size``, ``interpolation``, ``mean``, ``std``, ``crop_pct``, ``crop_mode``)."""

    def load_context(self, context) -> None:
        import torch
        from timm.data import create_transform

        self.model = torch.load(context.artifacts["model"], map_location="cpu", weights_only=False).eval()
        config = dict(context.model_config)
        self.classes: list[str] = list(config.pop("classes"))
        self.size = tuple(config["input_size"])
        self.transform = create_transform(**config, is_training=False)
        self.limits = ServeConfig()

    def set_limits(self, limits: ServeConfig) -> None:
        """The caps on what one request may ask (``pipeline serve`` sets its flags' here)."""
        self.limits = limits

    def _tensor(self, image: Any, index: int):
        import torch

        if isinstance(image, (list, np.ndarray)) and np.asarray(image).dtype.kind == "f":
            array = np.asarray(image, dtype=np.float32)
            if array.shape != self.size:
                raise BadInput(f"image {index}: a float array of shape {array.shape}; a normalised tensor must be "
                               f"{self.size}, else send uint8 pixels or an encoded image")
            if not np.isfinite(array).all():
                raise BadInput(f"image {index}: the float tensor holds NaN or infinity")
            return torch.from_numpy(array)
        return self.transform(_decoded(image, index, self.limits.max_pixels))

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        import torch

        top_k = int((params or {}).get("top_k", TOP_K))
        if not 1 <= top_k <= len(self.classes):
            raise BadInput(f"top_k {top_k}: give 1 to {len(self.classes)} (the classes)")
        images = _column(model_input)
        if len(images) > self.limits.max_images:  # before any is decoded
            raise BadInput(f"{len(images)} images in one request, over the cap of {self.limits.max_images}; "
                           "split them over several requests (`pipeline serve --max-images` sets the cap)")
        batch = torch.stack([self._tensor(image, i) for i, image in enumerate(images)])
        with torch.no_grad():
            probs = self.model(batch).float().softmax(-1)
        values, indices = probs.topk(top_k, dim=-1)
        rows = []
        for value, index in zip(values.tolist(), indices.tolist()):
            ranked = [{"index": i, "label": self.classes[i], "probability": p} for i, p in zip(index, value)]
            rows.append({**ranked[0], "top_k": ranked})
        return pd.DataFrame(rows, columns=["index", "label", "probability", "top_k"])


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
