"""DeepSeek-V4.1 image preprocessing (docs/models.md): image -> normalised 14x14 RGB patches + grid.

Pipeline (per image):

1. Decode (PIL.Image, PNG/JPEG/... bytes, or a path) and convert to RGB.
2. Plan the pixel size: optionally clamp the logical width to `max_wh_ratio * height`;
   upscale (keeping the aspect ratio) to at least `min_pixels`; round both sides up to a
   multiple of `patch_size`. If the span would exceed the token budget
   `llm_h * (llm_w + 1) + 2 <= max_image_tokens` (llm_h = ceil(vit_h / 3), llm_w =
   ceil(vit_w / 3)), shrink instead so that the image fits (see `plan_image_grid`).
3. Fit the image into that size: aspect-preserving resize (bicubic) centred on grey
   (127, 127, 127) padding — or a plain stretch when `max_wh_ratio` is set and the image
   is at least that wide.
4. Pixels -> (x / 255 - 0.5) / 0.5, rounded to bfloat16 (the reference feeds bf16 patches;
   the values are returned in float32 so an fp32 ViT sees exactly the reference's inputs),
   cut into row-major patches [vit_h * vit_w, 3, patch, patch].

`image_token_span(...)` is the number of sequence positions the image occupies:
IMAGE_START, llm_h rows of (llm_w IMAGE + IMAGE_NEW_LINE), IMAGE_END; every one of them
carries `image_token_id` (129264 in the release, = the chat placeholder
`<｜deepseek_image｜>`), which a caller expands from one placeholder into that many.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch

# Span position types (the values NeMo's `vision_token_types` uses; TEXT = -1 elsewhere).
TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3
PAD_GREY = (127, 127, 127)


@dataclass(frozen=True)
class VisionPreprocessConfig:
    """The image-sizing fields of `vision_config` (defaults: the release)."""

    patch_size: int = 14
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "VisionPreprocessConfig":
        d = d or {}
        kw = {k: d[k] for k in ("patch_size", "downsample_ratio", "max_image_tokens", "min_pixels",
                                 "max_wh_ratio") if k in d}
        return cls(**kw)


@dataclass(frozen=True)
class ImageGrid:
    """Planned pixel size (height x width, multiples of patch_size) and the two grids."""

    height: int
    width: int
    n_vit_h: int
    n_vit_w: int
    llm_h: int
    llm_w: int

    @property
    def num_tokens(self) -> int:
        return self.llm_h * (self.llm_w + 1) + 2


@dataclass
class ImageInput:
    """One preprocessed image.

    patches: float32 [n_vit_h * n_vit_w, 3, patch, patch], row-major over the ViT grid.
    num_tokens: span length = llm_h * (llm_w + 1) + 2.
    """

    patches: torch.Tensor
    n_vit_h: int
    n_vit_w: int
    llm_h: int
    llm_w: int
    num_tokens: int

    def token_types(self) -> list[int]:
        """Per-position types of the span: START, (IMAGE x llm_w, NEW_LINE) x llm_h, END."""
        return [IMAGE_START] + ([IMAGE] * self.llm_w + [IMAGE_NEW_LINE]) * self.llm_h + [IMAGE_END]


def _as_cfg(config: VisionPreprocessConfig | dict | None) -> VisionPreprocessConfig:
    if isinstance(config, VisionPreprocessConfig):
        return config
    return VisionPreprocessConfig.from_dict(config)


def _round_to_patch(x: float, patch: int, up: bool) -> int:
    return (math.ceil(x / patch) if up else math.floor(x / patch)) * patch


def plan_image_grid(width: int, height: int, config: VisionPreprocessConfig | dict | None = None) -> ImageGrid:
    """Pixel size and grids for an image of `width` x `height` pixels (docs/models.md)."""
    c = _as_cfg(config)
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if c.max_image_tokens < 4:
        raise ValueError("max_image_tokens must be >= 4")
    p, r, budget = c.patch_size, c.downsample_ratio, c.max_image_tokens

    def grids(h_px: int, w_px: int) -> tuple[int, int]:
        return math.ceil((h_px // p) / r), math.ceil((w_px // p) / r)

    # logical size: width clamp for very wide images, then upscale to min_pixels
    lw: float = width
    lh: float = height
    if c.max_wh_ratio is not None and width > height * c.max_wh_ratio:
        lw = height * c.max_wh_ratio
    if lw * lh < c.min_pixels:
        up = math.sqrt(c.min_pixels / (lw * lh))
        lw, lh = int(lw * up), int(lh * up)
    w_px, h_px = _round_to_patch(lw, p, True), _round_to_patch(lh, p, True)
    llm_h, llm_w = grids(h_px, w_px)
    if llm_h * (llm_w + 1) + 2 > budget:
        # largest llm_w with llm_w * aspect * (llm_w + 1) <= budget - 2 (real-valued), then scale
        aspect = lh / lw
        max_w = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
        max_h = max_w * aspect
        cell = p * r
        if max_w < 1:          # extremely tall: one column, as many rows as fit
            h_px, w_px = (budget - 2) // 2 * cell, cell
        elif max_h < 1:        # extremely wide: one row
            h_px, w_px = cell, (budget - 3) * cell
        else:
            scale = min(math.floor(max_w) * cell / lw, math.floor(max_h) * cell / lh)
            h_px = _round_to_patch(lh * scale, p, False)
            w_px = _round_to_patch(lw * scale, p, False)
        llm_h, llm_w = grids(h_px, w_px)
    if min(h_px, w_px) <= 0 or llm_h * (llm_w + 1) + 2 > budget:
        raise ValueError(f"a {width}x{height} image cannot fit in {budget} image tokens")
    return ImageGrid(h_px, w_px, h_px // p, w_px // p, llm_h, llm_w)


ImageLike = Union["PIL.Image.Image", bytes, bytearray, str, Path]  # noqa: F821


def load_image(image: ImageLike):
    """A PIL RGB image from a PIL image, encoded bytes (PNG/JPEG/...) or a file path."""
    from PIL import Image
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (bytes, bytearray, memoryview)):
        with Image.open(io.BytesIO(bytes(image))) as im:
            return im.convert("RGB")
    if isinstance(image, (str, Path)):
        with Image.open(image) as im:
            return im.convert("RGB")
    raise TypeError(f"unsupported image type {type(image).__name__}")


def preprocess_image(image: ImageLike, config: VisionPreprocessConfig | dict | None = None,
                     round_bf16: bool = True) -> ImageInput:
    """Decode, resize/pad, normalise and patchify one image (see the module docstring).
    `config` is a VisionPreprocessConfig or the checkpoint's `vision_config` dict."""
    from PIL import ImageOps
    c = _as_cfg(config)
    im = load_image(image)
    g = plan_image_grid(im.width, im.height, c)
    if c.max_wh_ratio is not None and im.width >= c.max_wh_ratio * im.height:
        im = im.resize((g.width, g.height))
    else:
        im = ImageOps.pad(im, (g.width, g.height), color=PAD_GREY)
    x = torch.from_numpy(np.array(im, dtype=np.float32)).permute(2, 0, 1)   # [3, H, W]
    x = (x / 255 - 0.5) / 0.5
    if round_bf16:
        x = x.to(torch.bfloat16)
    x = x.float()
    p = c.patch_size
    patches = (x.reshape(3, g.n_vit_h, p, g.n_vit_w, p).permute(1, 3, 0, 2, 4)
               .reshape(g.n_vit_h * g.n_vit_w, 3, p, p).contiguous())
    return ImageInput(patches, g.n_vit_h, g.n_vit_w, g.llm_h, g.llm_w, g.num_tokens)


def image_token_span(image: ImageInput | ImageGrid) -> int:
    """Number of sequence positions (all = image_token_id) the image occupies."""
    return image.llm_h * (image.llm_w + 1) + 2


def expand_image_placeholders(token_ids: list[int], images: list[ImageInput], image_token_id: int
                              ) -> tuple[list[int], list[int]]:
    """Replace the k-th `image_token_id` in `token_ids` by images[k]'s span (all image_token_id).
    Returns (expanded ids, start position of each image span)."""
    out: list[int] = []
    starts: list[int] = []
    k = 0
    for t in token_ids:
        if t != image_token_id:
            out.append(t)
            continue
        if k >= len(images):
            raise ValueError("more image placeholders than images")
        starts.append(len(out))
        out.extend([image_token_id] * image_token_span(images[k]))
        k += 1
    if k != len(images):
        raise ValueError(f"{len(images)} images for {k} placeholders")
    return out, starts
