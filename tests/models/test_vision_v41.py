"""DeepSeek-V4.1 vision encoder + image preprocessing vs NVIDIA NeMo AutoModel (CPU, fp32)."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

pytest.importorskip("nemo_automodel")
PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from deepinfer.loader.checkpoint import CheckpointReader  # noqa: E402
from deepinfer.models.image_processor_v41 import (IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START,  # noqa: E402
                                                  VisionPreprocessConfig, expand_image_placeholders,
                                                  image_token_span, plan_image_grid, preprocess_image)
from deepinfer.loader.model_loader import load_model  # noqa: E402
from deepinfer.tools.make_checkpoint import PRESETS, weight_specs, write_checkpoint  # noqa: E402

from nemo_oracle import (nemo_preprocess_image, nemo_v41_image_span_embeddings,  # noqa: E402
                          nemo_v41_logits_with_images, nemo_v41_model)


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    # smooth-ish content plus noise so that resampling and padding matter
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 255 // max(w - 1, 1)), (yy * 255 // max(h - 1, 1)), (xx + yy) % 256], -1)
    arr = np.clip(base + rng.integers(-40, 40, size=(h, w, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(arr, "RGB")


IMAGES = [(50, 30, 0), (20, 45, 1)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("v41v") / "tiny41v", PRESETS["tiny41v"], seed=0)


@pytest.fixture(scope="module")
def vcfg(ckpt):
    return json.loads((ckpt / "config.json").read_text())


@pytest.fixture(scope="module")
def nemo(ckpt):
    model, _ = nemo_v41_model(ckpt)
    return model


def _is_vision_tensor(name: str) -> bool:
    return name.startswith(("vision.", "aligner.")) or name in ("image_start", "image_newline", "image_end")


@pytest.fixture(scope="module")
def ours(ckpt):
    """The V4.1 model as the engine loads it: its vision tower and delimiters come from the checkpoint."""
    return load_model(str(ckpt), dtype=torch.float32)[0]


def test_vision_tensors_released_layout(ckpt, vcfg, ours):
    r = CheckpointReader(ckpt)
    names = {n for n in r.names() if _is_vision_tensor(n)}
    assert names == {n for n, _ in ours.named_parameters() if _is_vision_tensor(n)}
    for n in names:   # plain bf16, fp32 RMSNorm weights, no FP8 / scales
        want = torch.float32 if n.endswith(("norm1.weight", "norm2.weight")) or n == "vision.norm.weight" \
            else torch.bfloat16
        assert r.dtype(n) == want, n
        assert n + ".scale" not in r and n.removesuffix(".weight") + ".scale" not in r
    assert {s.name for s in weight_specs(vcfg)} >= names
    assert not any(_is_vision_tensor(s.name) for s in weight_specs(PRESETS["tiny41"]))


@pytest.mark.parametrize("w,h,seed", IMAGES)
def test_preprocessing_matches_nemo(nemo, vcfg, w, h, seed):
    img = _image(w, h, seed)
    ours = preprocess_image(img, vcfg["vision_config"])
    p, g = nemo_preprocess_image(nemo, img)
    assert (ours.n_vit_h, ours.n_vit_w, ours.llm_h, ours.llm_w) == (g.vit_height, g.vit_width,
                                                                    g.llm_height, g.llm_width)
    assert ours.patches.dtype == torch.float32 and ours.patches.shape == p.shape
    assert torch.equal(ours.patches, p.float())
    assert ours.num_tokens == image_token_span(ours) == g.llm_height * (g.llm_width + 1) + 2
    # the same image given as PNG bytes
    buf = io.BytesIO()
    img.save(buf, "PNG")
    assert torch.equal(preprocess_image(buf.getvalue(), vcfg["vision_config"]).patches, ours.patches)


def test_tiny_grids(vcfg):
    # min_pixels 10000 upscales both test images; both ViT grids need zero padding in the aligner
    g1 = preprocess_image(_image(50, 30, 0), vcfg["vision_config"])
    g2 = preprocess_image(_image(20, 45, 1), vcfg["vision_config"])
    assert (g1.n_vit_h, g1.n_vit_w, g1.llm_h, g1.llm_w, g1.num_tokens) == (6, 10, 2, 4, 12)
    assert (g2.n_vit_h, g2.n_vit_w, g2.llm_h, g2.llm_w, g2.num_tokens) == (11, 5, 4, 2, 14)


@pytest.mark.parametrize("size", [(50, 30), (20, 45), (300, 200), (1000, 20), (20, 1000), (7, 7), (640, 480),
                                  (10, 2000), (2000, 10), (2000, 1500)])
@pytest.mark.parametrize("cfg", [dict(max_image_tokens=64, min_pixels=10000),
                                 dict(max_image_tokens=64, min_pixels=10000, max_wh_ratio=2.0),
                                 dict()])
def test_grid_plan_matches_nemo(size, cfg):
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41VisionConfig
    from nemo_automodel.components.models.deepseek_v41.processing import _plan_image_grid
    g = _plan_image_grid(*size, DeepseekV41VisionConfig(**cfg))
    ours = plan_image_grid(*size, VisionPreprocessConfig(**cfg))
    assert (ours.height, ours.width, ours.n_vit_h, ours.n_vit_w, ours.llm_h, ours.llm_w) == \
        (g.height, g.width, g.vit_height, g.vit_width, g.llm_height, g.llm_width)
    assert ours.num_tokens <= VisionPreprocessConfig(**cfg).max_image_tokens


@pytest.mark.parametrize("size", [(300, 40), (40, 300), (90, 70)])
def test_wide_and_budget_preprocessing_matches_nemo(size):
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41VisionConfig
    from nemo_automodel.components.models.deepseek_v41.processing import _preprocess_image
    cfg = dict(max_image_tokens=64, min_pixels=10000, max_wh_ratio=2.0)
    img = _image(*size, 3)
    p, g = _preprocess_image(img, DeepseekV41VisionConfig(**cfg))
    ours = preprocess_image(img, cfg)
    assert torch.equal(ours.patches, p.float())


def test_embed_image_matches_nemo(nemo, ours, vcfg):
    imgs = [_image(w, h, s) for w, h, s in IMAGES]
    ref = nemo_v41_image_span_embeddings(nemo, imgs)
    for img, r in zip(imgs, ref):
        inp = preprocess_image(img, vcfg["vision_config"])
        got = ours.image_embeddings(inp)
        assert got.shape == r.shape == (inp.num_tokens, vcfg["text_config"]["hidden_size"])
        assert (got - r).abs().max().item() < 1e-5
        # delimiters at their positions
        types = inp.token_types()
        assert types[0] == IMAGE_START and types[-1] == IMAGE_END
        for t, row in zip(types, got):
            if t == IMAGE_NEW_LINE:
                assert torch.equal(row, ours.image_newline)
        assert sum(t == IMAGE for t in types) == inp.llm_h * inp.llm_w
    # ImageInput fed to NeMo directly gives the same embeddings (patches are NeMo's bf16 values)
    ref2 = nemo_v41_image_span_embeddings(nemo, [preprocess_image(i, vcfg["vision_config"]) for i in imgs])
    for a, b in zip(ref, ref2):
        assert torch.equal(a, b)


def test_expand_placeholders(vcfg):
    a = preprocess_image(_image(50, 30, 0), vcfg["vision_config"])
    b = preprocess_image(_image(20, 45, 1), vcfg["vision_config"])
    ids, starts = expand_image_placeholders([5, 1022, 6, 7, 1022, 8], [a, b], 1022)
    assert starts == [1, 1 + 12 + 2]
    assert len(ids) == 4 + 12 + 14 and ids.count(1022) == 26
    with pytest.raises(ValueError):
        expand_image_placeholders([5, 1022], [a, b], 1022)


def _logits_with_images(llm, ids: list[int], images: list, starts: list[int]) -> torch.Tensor:
    """deepinfer's logits [S, V] at every position of `ids` with the images' spans at `starts`: one
    prefill through the engine (placeholders expanded, spans embedded by the model's vision tower),
    reading the model's output rows."""
    from deepinfer import SamplingParams

    img_tok, prompt, at = llm.model.config.image_token_id, [], 0
    for img, s in zip(images, starts):
        prompt += ids[at:s] + [img_tok]
        at = s + preprocess_image(img, llm.model.config.vision).num_tokens
    prompt += ids[at:]
    rows = []
    hook = llm.model.register_forward_hook(lambda module, args, out: rows.append(out))
    try:
        out = llm.generate({"prompt_token_ids": prompt, "images": images},
                           SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    finally:
        hook.remove()
    assert len(rows) == 1 and rows[0].shape[0] == len(ids) == len(out.prompt_token_ids)
    with torch.inference_mode():
        return llm.model.compute_logits(rows[0]).float()


def test_full_model_logits_with_images_match_nemo(ckpt, nemo, vcfg):
    from deepinfer import LLM

    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory=32 << 20,
              yoco_prefill_truncation_mode="none")  # every position computed in full
    ids, starts = (torch.arange(48) % 50 + 3).tolist(), [2, 20]
    imgs = [_image(w, h, s) for w, h, s in IMAGES]
    other = [_image(50, 30, 9), imgs[1]]  # another first image
    ours = {}
    for name, pics in (("imgs", imgs), ("other", other)):
        ours[name] = _logits_with_images(llm, ids, pics, starts)
        ref = nemo_v41_logits_with_images(nemo, torch.tensor(ids), pics, starts, exact=True)[0]
        assert ours[name].shape == ref.shape == (48, vcfg["text_config"]["vocab_size"])
        err, scale = (ours[name] - ref).abs().max().item(), ref.abs().max().item()
        assert err <= 1e-4 * scale, f"{name}: max |diff| {err:.3g} vs logit scale {scale:.3g}"
    # the first image's content reaches every position after its span's start token, none before
    assert torch.equal(ours["imgs"][:3], ours["other"][:3])
    diff = (ours["imgs"][3:] - ours["other"][3:]).abs().amax(-1)
    assert (diff > 1e-3 * ours["imgs"].abs().max()).all(), diff
