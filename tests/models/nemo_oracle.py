"""NVIDIA NeMo AutoModel's DeepSeek-V4.1 as a CPU reference (see shared/spec/v41-oracle.md).

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


@torch.no_grad()
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
