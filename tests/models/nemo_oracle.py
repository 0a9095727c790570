"""NVIDIA NeMo AutoModel's DeepSeek-V4.1 (`nemo_automodel`, model type deepseek_v41) as a CPU reference.

The checkpoint is read through NeMo's own state-dict adapter (`from_hf` dequantises the
FP8 / FP4 tensors itself), so the oracle also checks our checkpoint layout independently of
deepinfer's loader. Needs `nemo-automodel` (installed with --no-deps), transformers, pillow;
set TORCHDYNAMO_DISABLE=1 (tests/conftest.py does).
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import load_file

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

_V41 = "nemo_automodel.components.models.deepseek_v41"


def _backend():
    from nemo_automodel.components.models.common import BackendConfig
    return BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope="torch", experts="torch",
                         dispatcher="torch", enable_hf_state_dict_adapter=True)


def _read_checkpoint(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt_dir.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def nemo_v41_config(ckpt_dir: str | Path, dtype: str = "float32"):
    """NeMo's DeepseekV41Config from our config.json, text dtype forced to `dtype`."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    cfg = json.loads((Path(ckpt_dir) / "config.json").read_text())
    text = {k: v for k, v in cfg.pop("text_config").items() if k != "model_type"}
    vision = {k: v for k, v in cfg.pop("vision_config").items() if k != "model_type"}
    text["dtype"] = dtype
    for k in ("model_type", "architectures", "dtype", "torch_dtype"):
        cfg.pop(k, None)
    return DeepseekV41Config(text_config=text, vision_config=vision, dtype=dtype, **cfg)


def nemo_tokenizer(ckpt_dir: str | Path):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_file=str(Path(ckpt_dir) / "tokenizer.json"))


def nemo_v41_model(ckpt_dir: str | Path):
    """(NeMo DeepseekV41ForCausalLM in fp32 eval mode with our checkpoint loaded strictly,
    the PreTrainedTokenizerFast it hashes Engram n-grams with)."""
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    ckpt_dir = Path(ckpt_dir)
    config = nemo_v41_config(ckpt_dir)
    tok = nemo_tokenizer(ckpt_dir)
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(config, backend=_backend(), tokenizer=tok)
    model.initialize_weights(torch.device("cpu"), dtype=torch.float32)
    sd = model.state_dict_adapter.from_hf(_read_checkpoint(ckpt_dir))
    model.load_state_dict(sd, strict=True)
    return model.eval(), tok


@contextlib.contextmanager
def no_cache_quant(*modules: str):
    """Replace NeMo's quantize_cache (the reference's FP8 / MXFP4 / NVFP4 round trips of SWA KV,
    index q/k and compressed KV) by the identity inside `modules` (default: attention, dspark)."""
    import importlib
    names = modules or ("attention", "dspark")
    with contextlib.ExitStack() as stack:
        for name in names:
            mod = importlib.import_module(f"{_V41}.{name}")
            stack.enter_context(mock.patch.object(mod, "quantize_cache", lambda values, **_: values))
        yield


# Text prompts for the trained demo (deepinfer/assets/demo41: Python source), written for these checks; each is
# encoded with the demo's tokenizer, BOS first, cut to DEMO_PROMPT_TOKENS.
DEMO_PROMPTS = (
    "import os\n\n\ndef read_lines(path):\n    \"\"\"Return the lines of the file at path.\"\"\"\n"
    "    with open(path) as f:\n        return [line.rstrip('\\n') for line in f]\n\n\ndef count_words(",
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, key):\n"
    "        self.counts[key] = self.counts.get(key, 0) + 1\n\n    def most_common(self, n=None):\n",
    "def _parse_header(line):\n    if not line.startswith('#'):\n        raise ValueError('not a header: %r' % (line,))\n"
    "    name, _, value = line[1:].partition('=')\n    return name.strip(), value.strip()\n\n",
    "try:\n    import json\nexcept ImportError:\n    json = None\n\n__all__ = ['dump', 'load']\n\n\n"
    "def dump(obj, fp, *, indent=None):\n    if json is None:\n        raise RuntimeError(",
)
DEMO_PROMPT_TOKENS = 48


def demo_prompts(tokenizer) -> list[list[int]]:
    """DEMO_PROMPTS as token ids (`tokenizer`: a tokenizers.Tokenizer), BOS (0) first."""
    return [[0] + tokenizer.encode(text).ids[:DEMO_PROMPT_TOKENS] for text in DEMO_PROMPTS]


@torch.no_grad()
def teacher_forced_gap(llm, prompts: list[list[int]], ref_logprobs, max_tokens: int = 10) -> tuple[float, int, int]:
    """Greedy generations of `llm` (top-5 logprobs), then the reference's fp32 logprobs on every
    generated prefix (`ref_logprobs(prefix) -> [V]`): (largest |logprob - reference| over the
    returned logprobs, positions where the reference's argmax is the token chosen, positions)."""
    from deepinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    worst, agree, total = 0.0, 0, 0
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        seq = list(prompt)
        for tok, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
            with torch.inference_mode():
                ref = ref_logprobs(seq)
            worst = max(worst, max(abs(v - ref[t].item()) for t, v in lp.items()))
            agree += int(ref.argmax()) == tok
            total += 1
            seq.append(tok)
    return worst, agree, total


def nemo_v41_logits(model, input_ids: torch.Tensor, exact: bool = False, **kwargs) -> torch.Tensor:
    """fp32 logits [B, S, V] of a full-sequence forward (positions 0..S-1). exact=True drops the
    reference's cache quantisation round trips (for a float32-KV engine)."""
    ctx = no_cache_quant() if exact else contextlib.nullcontext()
    with ctx:
        return model(input_ids.long(), **kwargs).logits.float()


@torch.no_grad()
def nemo_v41_hidden_streams(model, input_ids: torch.Tensor, exact: bool = False) -> tuple[torch.Tensor, ...]:
    """The [B, S, hc_mult, D] residual streams entering every backbone layer."""
    ctx = no_cache_quant() if exact else contextlib.nullcontext()
    with ctx:
        return tuple(model(input_ids.long(), output_hidden_states=True).hidden_states)


# ---------------------------------------------------------------- DSpark draft (mtp.*)

def nemo_dspark_model(ckpt_dir: str | Path, target):
    """NeMo's DeepseekV41DSparkModel (fp32) with the checkpoint's mtp.* (+ embed/head) loaded strictly."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41DSparkConfig
    ckpt_dir = Path(ckpt_dir)
    t = target.config.text_config
    draft = DeepseekV41DSparkConfig(
        text_config=t, num_draft_layers=t.num_nextn_predict_layers,
        target_layer_ids=tuple(t.dspark_target_layer_ids), block_size=t.dspark_block_size, num_anchors=1,
        mask_token_id=t.dspark_noise_token_id, markov_rank=t.dspark_markov_rank, markov_head_type="vanilla",
        confidence_head_alpha=1.0, confidence_head_with_markov=True).build()
    sd = {k: v for k, v in _read_checkpoint(ckpt_dir).items()
          if k.startswith("mtp.") or k in ("embed.weight", "head.weight")}
    draft.load_state_dict(draft.state_dict_adapter.from_hf(sd), strict=True)
    return draft.float().eval()


@torch.no_grad()
def nemo_dspark_features(target, input_ids: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """[B, S, len(targets) * D]: the streams entering each DSpark target layer, averaged over
    the hc streams, concatenated in target-layer order."""
    ids = list(target.config.text_config.dspark_target_layer_ids)
    captured: dict[int, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, i=i: captured.__setitem__(i, args[0].float().mean(2)))
             for i, m in zip(ids, target.get_dspark_target_feature_modules(ids))]
    try:
        nemo_v41_logits(target, input_ids, exact=exact)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([captured[i] for i in ids], dim=-1)


@dataclass
class DSparkBlock:
    tokens: torch.Tensor            # [B, block] greedy drafts (token p+1 ... p+block)
    logits: torch.Tensor            # [B, block, V] base + Markov logits used for each pick
    base_logits: torch.Tensor       # [B, block, V] lm_head(norm(hidden))
    confidence_raw: torch.Tensor    # [B, block] sigmoid(proj([pre-norm hidden ; markov emb])) (released)
    confidence_norm: torch.Tensor   # [B, block] same on the normalised hidden (NeMo-trained drafts)
    hidden: torch.Tensor            # [B, block, D] pre-norm collapsed hidden of the last stage


@torch.no_grad()
def nemo_dspark_block(draft, features: torch.Tensor, input_ids: torch.Tensor, anchor: int,
                      exact: bool = False) -> DSparkBlock:
    """One greedy draft block at `anchor` (position of the newest accepted token): inputs
    [token_anchor, noise x (block-1)], context = features at positions < anchor."""
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkBackbone
    t = draft.config
    b, s = input_ids.shape
    blk = t.dspark_block_size
    anchors = torch.full((b, 1), anchor, dtype=torch.long)
    keep = torch.ones(b, 1, dtype=torch.bool)
    inputs = torch.full((b, blk), t.dspark_noise_token_id, dtype=torch.long)
    inputs[:, 0] = input_ids[:, anchor]
    emb = draft.embed_tokens(inputs).float()
    last = draft.mtp[-1]
    seen: dict[str, torch.Tensor] = {}
    hook = last.norm.register_forward_pre_hook(lambda mod, args: seen.__setitem__("h", args[0].float()))
    ctx = no_cache_quant() if exact else contextlib.nullcontext()
    try:
        with ctx:
            out = DeepseekV41DSparkBackbone.forward(
                draft, emb, features[:, :s].float(), position_ids=draft.build_position_ids(anchors, s),
                attention_mask=draft.build_attention_mask(anchors, keep, s, emb.dtype))
    finally:
        hook.remove()
    normed = out.normalized_hidden_states.float()
    base = draft.compute_logits(normed)
    prev = inputs[:, 0]
    toks, logits, c_raw, c_norm = [], [], [], []
    for i in range(blk):
        trans, m_emb = last.markov_head(prev)
        li = base[:, i] + trans.float()
        c_raw.append(torch.sigmoid(last.confidence_head(seen["h"][:, i], m_emb)))
        c_norm.append(torch.sigmoid(last.confidence_head(normed[:, i], m_emb)))
        prev = li.argmax(-1)
        toks.append(prev)
        logits.append(li)
    return DSparkBlock(torch.stack(toks, 1), torch.stack(logits, 1), base, torch.stack(c_raw, 1),
                       torch.stack(c_norm, 1), seen["h"])


# ---------------------------------------------------------------- images
#
# What NeMo's DeepseekV41ForCausalLM.forward expects for images (batch row b, image k):
#   input_ids          [B, S]: every position of an image span holds config.image_token_id
#                      (1022 in tiny41v, 129264 in the release); NeMo raises otherwise.
#   vision_token_types [B, S] int64: -1 on text; on a span, 0 (IMAGE_START), then llm_h rows of
#                      llm_w x 1 (IMAGE) followed by 2 (IMAGE_NEW_LINE), then 3 (IMAGE_END).
#                      Span length = llm_h * (llm_w + 1) + 2, llm_h/w = ceil(vit_h/w / 3).
#   pixel_values       [sum_k vit_h*vit_w, 3, 14, 14]: every image's row-major patches,
#                      concatenated in (batch row, span position) order; NeMo's processor makes
#                      them bf16 ((x/255-0.5)/0.5 rounded), the ViT casts to its weight dtype.
#   image_grid_hws     [images, 2] int64: (vit_h, vit_w) per image, same order.
# NeMo then embeds the span (image_start, aligner rows + image_newline, image_end) in place of
# the token embeddings, and uses image_mask = vision_token_types >= 0 for Engram (hash blocked,
# gate zero) and the MoE gate's bias_vl. Positions are plain 0..S-1; attention is causal.

def nemo_preprocess_image(model, image):
    """NeMo's own preprocessing: (patches bf16 [P, 3, p, p], its _ImageGrid)."""
    from nemo_automodel.components.models.deepseek_v41.processing import _preprocess_image
    return _preprocess_image(image, model.config.vision_config)


def nemo_v41_image_inputs(model, input_ids: torch.Tensor, images: list, starts: list[int]) -> dict:
    """Model kwargs for a [1, S] (or [S]) sequence with image spans starting at `starts`.

    `images[k]` is a PIL image / encoded bytes (preprocessed by NeMo itself) or an object with
    .patches/.n_vit_h/.n_vit_w/.llm_h/.llm_w (e.g. deepinfer's ImageInput). The span positions
    of input_ids are overwritten with image_token_id. Returns dict(input_ids, pixel_values,
    image_grid_hws, vision_token_types)."""
    ids = input_ids.long().reshape(1, -1).clone()
    types = torch.full_like(ids, -1)
    patches, grids = [], []
    for img, start in sorted(zip(images, starts), key=lambda p: p[1]):
        if hasattr(img, "patches"):
            p, vh, vw, lh, lw = img.patches, img.n_vit_h, img.n_vit_w, img.llm_h, img.llm_w
        else:
            p, g = nemo_preprocess_image(model, img)
            vh, vw, lh, lw = g.vit_height, g.vit_width, g.llm_height, g.llm_width
        span = [0] + ([1] * lw + [2]) * lh + [3]
        if start + len(span) > ids.shape[1] or torch.any(types[0, start:start + len(span)] >= 0):
            raise ValueError(f"image span at {start} (length {len(span)}) does not fit / overlaps")
        types[0, start:start + len(span)] = torch.tensor(span)
        ids[0, start:start + len(span)] = model.config.image_token_id
        patches.append(p)
        grids.append((vh, vw))
    return dict(input_ids=ids, pixel_values=torch.cat(patches),
                image_grid_hws=torch.tensor(grids, dtype=torch.long), vision_token_types=types)


@torch.no_grad()
def nemo_v41_logits_with_images(model, input_ids: torch.Tensor, images: list, starts: list[int],
                                exact: bool = False) -> torch.Tensor:
    """fp32 logits [1, S, V] of NeMo's full forward with the given image spans (see above)."""
    kw = nemo_v41_image_inputs(model, input_ids, images, starts)
    ctx = no_cache_quant() if exact else contextlib.nullcontext()
    with ctx:
        return model(kw.pop("input_ids"), **kw).logits.float()


@torch.no_grad()
def nemo_v41_image_span_embeddings(model, images: list, text_len: int = 3) -> list[torch.Tensor]:
    """Per image, NeMo's `_image_embeddings` rows [span_len, D] at its span, for a sequence of
    `text_len` text tokens, then each image span separated by `text_len` text tokens."""
    spans, pos = [], text_len
    prepared = []
    for img in images:
        if hasattr(img, "patches"):
            n = img.llm_h * (img.llm_w + 1) + 2
        else:
            p, g = nemo_preprocess_image(model, img)
            n = g.llm_height * (g.llm_width + 1) + 2
        prepared.append(img)
        spans.append((pos, n))
        pos += n + text_len
    ids = torch.arange(pos) % 7 + 3
    kw = nemo_v41_image_inputs(model, ids, prepared, [s for s, _ in spans])
    emb = model.model._image_embeddings(kw["input_ids"], kw["pixel_values"], kw["image_grid_hws"],
                                        kw["vision_token_types"])[0]
    return [emb[s:s + n].float() for s, n in spans]
