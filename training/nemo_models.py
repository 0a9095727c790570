"""NeMo AutoModel's DeepSeek-V4.1 target and DSpark draft, built from a released-layout config dict.

NeMo (`nemo_automodel.components.models.deepseek_v41`) is used as a library: its model classes,
state-dict adapters and the DSpark trainer's loss (`components.speculative.dspark.core`). The config
is the top-level config.json dict that `deepinfer.tools.make_checkpoint_v41.checkpoint_config_v41`
writes (nested text_config / vision_config); parameters are fp32 (autocast gives bf16 math on CUDA).
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

ATTN_BACKENDS = ("eager", "sdpa")
EXPERT_BACKENDS = ("torch", "torch_mm")


def backend(attn: str = "eager", experts: str = "torch"):
    """NeMo's BackendConfig: plain torch everywhere (`attn` eager|sdpa, `experts` torch|torch_mm)."""
    from nemo_automodel.components.models.common import BackendConfig
    if attn not in ATTN_BACKENDS:
        raise ValueError(f"attn backend {attn!r} is not one of {ATTN_BACKENDS}")
    if experts not in EXPERT_BACKENDS:
        raise ValueError(f"experts backend {experts!r} is not one of {EXPERT_BACKENDS}")
    return BackendConfig(attn=attn, linear="torch", rms_norm="torch_fp32", rope="torch", experts=experts,
                         dispatcher="torch", enable_hf_state_dict_adapter=True)


def nemo_config(config: dict):
    """NeMo's DeepseekV41Config (fp32) from a released top-level config dict."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    cfg = copy.deepcopy(config)
    text = {k: v for k, v in cfg.pop("text_config").items() if k != "model_type"}
    vision = {k: v for k, v in (cfg.pop("vision_config", None) or {"num_hidden_layers": 0}).items()
              if k != "model_type"}
    text["dtype"] = "float32"
    for k in ("model_type", "architectures", "dtype", "torch_dtype", "quantization_config", "expert_dtype"):
        cfg.pop(k, None)
    return DeepseekV41Config(text_config=text, vision_config=vision, dtype="float32", **cfg)


def hf_tokenizer(tokenizer_json: str | Path):
    """The transformers fast tokenizer NeMo hashes Engram n-grams with."""
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))


@dataclass
class Models:
    target: torch.nn.Module      # DeepseekV41ForCausalLM
    draft: torch.nn.Module       # DeepseekV41DSparkModel (embedding / head: frozen copies of the target's)
    trainer: torch.nn.Module     # DSparkTrainerModule: the draft's CE + L1 + confidence loss


def build_models(config: dict, tokenizer_json: str | Path, *, device: torch.device | str = "cpu",
                 num_anchors: int = 8, gate_bias_update: float = 1e-3, attn: str = "eager",
                 experts: str = "torch", seed: int = 0, loss_weights: tuple[float, float, float] = (0.1, 0.9, 1.0)
                 ) -> Models:
    """Target + draft at NeMo's own initialisation (seeded), in train mode on `device`.

    The target's routers keep DeepSeek's load-balancing correction bias, moved by `gate_bias_update`
    per step (0 disables). The lightning indexers are frozen: NeMo's V4.1 indexer scores under
    no_grad, so their weights stay at initialisation. `loss_weights` = (CE, L1, confidence) of
    NeMo's DSpark objective."""
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from nemo_automodel.components.moe.config import MoEConfig
    from nemo_automodel.components.speculative.dspark.core import DSparkTrainerModule

    ncfg = nemo_config(config)
    t = ncfg.text_config
    be = backend(attn, experts)
    moe = MoEConfig(dim=t.hidden_size, inter_dim=t.moe_intermediate_size, moe_inter_dim=t.moe_intermediate_size,
                    n_routed_experts=t.n_routed_experts, n_shared_experts=t.n_shared_experts,
                    n_activated_experts=t.num_experts_per_tok, n_expert_groups=0, n_limited_groups=0,
                    train_gate=True, gate_bias_update_factor=float(gate_bias_update), aux_loss_coeff=0.0,
                    score_func="sqrtsoftplus", route_scale=t.routed_scaling_factor, norm_topk_prob=t.norm_topk_prob,
                    router_weights_fp32=True, force_e_score_correction_bias=True, swiglu_limit=t.swiglu_limit,
                    dtype=torch.float32)
    torch.manual_seed(seed)
    target = DeepseekV41ForCausalLM(ncfg, moe, be, tokenizer=hf_tokenizer(tokenizer_json))
    target.initialize_weights(torch.device("cpu"), dtype=torch.float32)
    for name, p in target.named_parameters():
        if ".attn.indexer." in name:
            p.requires_grad_(False)
    draft = DeepseekV41DSparkModel(t, be, num_anchors=num_anchors, enable_confidence_head=True)
    draft.initialize_embeddings_and_head(embed_tokens=target.get_input_embeddings(),
                                         lm_head=target.get_output_embeddings())
    ce, l1, conf = loss_weights
    trainer = DSparkTrainerModule(draft, ce_loss_alpha=ce, l1_loss_alpha=l1, confidence_head_alpha=conf)
    target.to(device).train()
    trainer.to(device).train()
    return Models(target, draft, trainer)


def target_layer_ids(target) -> list[int]:
    return list(target.config.text_config.dspark_target_layer_ids)


class FeatureCapture:
    """Captures, during one target forward, what the DSpark draft reads: the residual streams entering
    each draft target layer (mean over the hc streams, concatenated in layer order: [B, S, n*D]) and
    the target's final-norm output [B, S, D]. Both detached: the draft's loss does not train the target."""

    def __init__(self, target):
        ids = target_layer_ids(target)
        self._ids = ids
        self._seen: dict[object, torch.Tensor] = {}
        mods = target.get_dspark_target_feature_modules(ids)
        self._hooks = [m.register_forward_pre_hook(self._pre(i)) for i, m in zip(ids, mods)]
        self._hooks.append(target.model.norm.register_forward_hook(self._post))

    def _pre(self, key: int):
        def hook(_mod, args):
            self._seen[key] = args[0].detach().float().mean(2)
        return hook

    def _post(self, _mod, _args, out):
        self._seen["norm"] = (out[0] if isinstance(out, tuple) else out).detach()

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        feats = torch.cat([self._seen[i] for i in self._ids], dim=-1)
        last = self._seen["norm"]
        self._seen = {}
        return feats, last

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def sync_draft_embeddings(models: Models) -> None:
    """The draft reads the target's current embedding and head (frozen copies, refreshed each step)."""
    models.draft.initialize_embeddings_and_head(embed_tokens=models.target.get_input_embeddings(),
                                                lm_head=models.target.get_output_embeddings())


def update_router_biases(target) -> None:
    """DeepSeek's auxiliary-loss-free balancing: each gate's correction bias moves by +-factor toward
    even expert load (NeMo's Gate.update_bias), once per optimizer step."""
    for layer in target.model.layers.values():
        gate = layer.ffn.gate
        if getattr(gate, "bias_update_factor", 0) > 0 and getattr(gate, "_cumulative_expert_load", None) is not None:
            gate.update_bias()
