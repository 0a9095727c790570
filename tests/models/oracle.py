"""Helpers that feed the same weights to transformers' DeepseekV4ForCausalLM (the V4 oracle)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

_HF_TYPES = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
             "hca": "heavily_compressed_attention"}


def deepseek_state_dict(model) -> dict[str, torch.Tensor]:
    """Our dense model's tensors under DeepSeek's checkpoint names (experts unstacked), fp32."""
    out = {}
    for name, t in model.state_dict().items():
        m = re.fullmatch(r"(.*\.experts)\.(w[123])", name)
        if m:
            for e in range(t.shape[0]):
                out[f"{m[1]}.{e}.{m[2]}.weight"] = t[e].float().contiguous()
        elif not name.startswith("mtp."):
            out[name] = t.contiguous() if t.dtype == torch.int64 else t.float().contiguous()
    return out


def hf_config_dict(cfg) -> dict:
    """transformers' spelling of our config (layer_types + compress_rates allow any HCA ratio)."""
    rates = {}
    for kind, r in zip(cfg.layer_kinds, cfg.compress_ratios):
        if kind != "sliding":
            rates[_HF_TYPES[kind]] = r
    yarn = cfg.rope_scaling
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": 1, "head_dim": cfg.head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank,
        "sliding_window": cfg.sliding_window,
        "layer_types": [_HF_TYPES[k] for k in cfg.layer_kinds], "compress_rates": rates,
        "num_hash_layers": cfg.num_hash_layers, "rope_theta": cfg.rope_theta,
        "compress_rope_theta": cfg.compress_rope_theta,
        "rope_scaling": None if yarn is None else {
            "type": "yarn", "factor": yarn.factor,
            "original_max_position_embeddings": yarn.original_max_position_embeddings,
            "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow},
        "max_position_embeddings": cfg.max_position_embeddings,
        "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.n_shared_experts, "moe_intermediate_size": cfg.moe_intermediate_size,
        "scoring_func": cfg.scoring_func, "norm_topk_prob": True,
        "routed_scaling_factor": cfg.routed_scaling_factor, "swiglu_limit": cfg.swiglu_limit,
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "rms_norm_eps": cfg.rms_norm_eps, "num_nextn_predict_layers": 0,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "tie_word_embeddings": False,
    }


def transformers_model(model, tmp_path: Path):
    """transformers' DeepseekV4ForCausalLM (fp32, eager) loaded from our model's weights."""
    import transformers

    d = Path(tmp_path) / "hf_oracle"
    d.mkdir(parents=True, exist_ok=True)
    save_file(deepseek_state_dict(model), str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(hf_config_dict(model.config)))
    hf, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        str(d), torch_dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"}
    assert not bad, f"transformers did not load every tensor: {bad}"
    return hf.eval()
