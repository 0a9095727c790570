"""DeepSeek-V4.1 vision encoder (unchanged from V4-Flash-Vision; docs/models.md): ViT + aligner +
learned image delimiters. Math only — no cache, one image at a time.

Parameter names are the released checkpoint's (all plain, never FP8):

  vision.patch_embed.proj.{weight [W, 3*p*p], bias [W]}                          bf16
  vision.blocks.N.norm1.weight [W], vision.blocks.N.norm2.weight [W]             fp32
  vision.blocks.N.attn.wqkv.{weight [3W, W], bias [3W]}                          bf16
  vision.blocks.N.attn.wo.{weight [W, W], bias [W]}                              bf16
  vision.blocks.N.mlp.w1.weight [2I, W] (gate rows, then up rows), mlp.w2.weight [W, I]   bf16
  vision.norm.weight [W]                                                         fp32
  aligner.w1.{weight [D, 9W], bias [D]}, aligner.w2.{weight [D, D], bias [D]}    bf16
  image_start, image_newline, image_end [D]                                      bf16

Numerics: linears / attention run in the module dtype; RMSNorm (eps 1e-6) and the 2-D RoPE
rotation are computed in fp32 and cast back, as in the reference.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.models.image_processor_v41 import ImageInput

VISION_EPS = 1e-6

# NeMo / released defaults of `vision_config`.
VISION_DEFAULTS = {
    "num_hidden_layers": 32, "hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 2816,
    "patch_size": 14, "rope_theta": 10000.0, "downsample_ratio": 3, "max_image_tokens": 1024,
    "min_pixels": 295936, "max_wh_ratio": None,
}


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class _Linear(nn.Module):
    """y = x W^T (+ b), dense weights in the module dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = VISION_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def vision_rope_angles(n_h: int, n_w: int, head_dim: int, theta: float,
                       device=None) -> torch.Tensor:
    """fp32 angles [n_h * n_w, head_dim / 2] of the half-split 2-D RoPE: rotary pair k
    (dims k and k + head_dim/2) turns by row * f_k for k < head_dim/4 and by
    column * f_(k - head_dim/4) otherwise, f_j = theta^(-4j / head_dim)."""
    quarter = head_dim // 4
    inv_freq = theta ** (-torch.arange(quarter, dtype=torch.float32, device=device) * 2 / (head_dim // 2))
    rows = torch.arange(n_h, dtype=torch.float32, device=device).repeat_interleave(n_w)
    cols = torch.arange(n_w, dtype=torch.float32, device=device).repeat(n_h)
    return torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [P, H, hd]; cos/sin [P, 1, hd/2]; pairs (k, k + hd/2)."""
    half = x.shape[-1] // 2
    xf = x.float()
    a, b = xf[..., :half], xf[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, width: int, n_heads: int, dtype: torch.dtype):
        super().__init__()
        if width % n_heads:
            raise ValueError("vision hidden_size must be divisible by num_attention_heads")
        self.n_heads, self.head_dim = n_heads, width // n_heads
        self.wqkv = _Linear(width, 3 * width, True, dtype)
        self.wo = _Linear(width, width, True, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        P = x.shape[0]
        q, k, v = self.wqkv(x).view(P, 3, self.n_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # full bidirectional attention over the image's patches; [H, P, hd]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           scale=1.0 / math.sqrt(self.head_dim))
        return self.wo(o.transpose(0, 1).reshape(P, -1))


class _MLP(nn.Module):
    def __init__(self, width: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.inter = inter
        self.w1 = _Linear(width, 2 * inter, False, dtype)
        self.w2 = _Linear(inter, width, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w1(x)
        return self.w2(F.silu(h[..., :self.inter]) * h[..., self.inter:])


class _Block(nn.Module):
    def __init__(self, width: int, n_heads: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.norm1 = _RMSNorm(width)
        self.attn = _Attention(width, n_heads, dtype)
        self.norm2 = _RMSNorm(width)
        self.mlp = _MLP(width, inter, dtype)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    def __init__(self, patch: int, width: int, dtype: torch.dtype):
        super().__init__()
        self.proj = _Linear(3 * patch * patch, width, True, dtype)


class VisionTransformer(nn.Module):
    """patches [P, 3, p, p] -> [P, W]."""

    def __init__(self, vc: dict, dtype: torch.dtype):
        super().__init__()
        self.width, self.n_heads = int(vc["hidden_size"]), int(vc["num_attention_heads"])
        self.head_dim = self.width // self.n_heads
        if self.head_dim % 4:
            raise ValueError("vision head_dim must be divisible by 4 (2-D RoPE)")
        self.theta = float(vc["rope_theta"])
        self.patch_embed = _PatchEmbed(int(vc["patch_size"]), self.width, dtype)
        self.blocks = nn.ModuleList(_Block(self.width, self.n_heads, int(vc["intermediate_size"]), dtype)
                                    for _ in range(int(vc["num_hidden_layers"])))
        self.norm = _RMSNorm(self.width)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        if patches.shape[0] != n_h * n_w:
            raise ValueError(f"{patches.shape[0]} patches for a {n_h}x{n_w} grid")
        x = self.patch_embed.proj(patches.flatten(1))
        ang = vision_rope_angles(n_h, n_w, self.head_dim, self.theta, device=x.device)[:, None, :]
        cos, sin = ang.cos(), ang.sin()
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.norm(x)


class VisionAligner(nn.Module):
    """[vit_h * vit_w, W] -> [llm_h * llm_w, D]: zero-pad the grid to multiples of r, gather
    each r x r cell channel-major (index c * r^2 + i * r + j), then w2(gelu(w1(.)))."""

    def __init__(self, width: int, ratio: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.ratio = ratio
        self.w1 = _Linear(width * ratio * ratio, hidden, True, dtype)
        self.w2 = _Linear(hidden, hidden, True, dtype)

    def merge(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        r, C = self.ratio, x.shape[-1]
        lh, lw = -(-n_h // r), -(-n_w // r)
        grid = x.new_zeros(lh * r, lw * r, C)
        grid[:n_h, :n_w] = x.view(n_h, n_w, C)
        return grid.view(lh, r, lw, r, C).permute(0, 2, 4, 1, 3).reshape(lh * lw, C * r * r)

    def forward(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(self.merge(x, n_h, n_w))))


@torch.no_grad()
def image_span_embeddings(owner: nn.Module, image: ImageInput) -> torch.Tensor:
    """[span_len, D] in token order: image_start, then per LLM row its llm_w aligner outputs
    followed by image_newline, then image_end. `owner` holds `vision`, `aligner` and the three
    delimiter vectors (the V4.1 model owns them at the top level, named as released)."""
    dev, dtype = owner.image_start.device, owner.image_start.dtype
    patches = image.patches.to(device=dev, dtype=dtype)
    feats = owner.aligner(owner.vision(patches, image.n_vit_h, image.n_vit_w), image.n_vit_h, image.n_vit_w)
    lh, lw = image.llm_h, image.llm_w
    if feats.shape[0] != lh * lw:
        raise ValueError(f"aligner gave {feats.shape[0]} tokens for a {lh}x{lw} LLM grid")
    D = owner.image_start.shape[0]
    rows = torch.cat([feats.view(lh, lw, D), owner.image_newline.view(1, 1, D).expand(lh, 1, D)], dim=1)
    return torch.cat([owner.image_start.view(1, D), rows.reshape(lh * (lw + 1), D), owner.image_end.view(1, D)])

