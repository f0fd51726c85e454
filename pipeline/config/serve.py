"""``pipeline serve``'s limits: what one request may ask of the served image classifier.

Not a section of an experiment's config (a served model is the same model whatever its server allows);
``pipeline serve`` fills it from its flags, and a model loaded with ``mlflow.pyfunc.load_model`` takes the
defaults. Triton and TorchServe cap the same three things (max batch size, max request size).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from pipeline.config.base import Section

# 40 MP covers the photos clients send (phones save 12 MP; APS-C and full-frame cameras 24 to 33 MP;
# an 8K frame is 33 MP) and holds a decoded image to 120 MB of RGB (240 MB at the peak of the RGB
# conversion): the server decodes one image at a time, so that is its peak per request. PIL's own
# decompression-bomb limit (89.5 MP, a warning; twice that, an error) lets an image take 270 to 540 MB.
MAX_PIXELS = 40_000_000
MAX_IMAGES = 64  # a request's model forward and decodes, at most; more images: more requests
MAX_BODY_MB = 64.0  # 64 JPEGs of 0.7 MB in base64, with room; larger bodies are refused before they are read


class ServeConfig(Section):
    """The limits one request to ``pipeline serve`` must stay within; over them it gets HTTP 400 or 413."""

    max_pixels: int = Field(MAX_PIXELS, ge=1, description="pixels (width x height) per image, read from the "
                            "image's header before it is decoded")
    max_images: int = Field(MAX_IMAGES, ge=1, description="images per request, counted before any is decoded")
    max_body_mb: float = Field(MAX_BODY_MB, gt=0, description="request body in MiB, checked against the "
                               "declared Content-Length before the body is read, and while a chunked body is read")

    @field_validator("max_pixels")
    @classmethod
    def _under_pil_limit(cls, max_pixels: int) -> int:
        from PIL import Image

        if Image.MAX_IMAGE_PIXELS is not None and max_pixels > Image.MAX_IMAGE_PIXELS:
            raise ValueError(f"{max_pixels} is over PIL's decompression-bomb limit ({Image.MAX_IMAGE_PIXELS} "
                             "pixels), past which PIL refuses or warns about an image itself; give at most that")
        return max_pixels

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)
