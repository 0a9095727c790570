"""The memory-fit arithmetic (engine/memory_fit.py) and the weight bytes it is given, checked against
the released V4-Flash and V4.1-Flash configurations built on the meta device."""
from __future__ import annotations

import re

import pytest
import torch

from deepinfer.engine.memory_fit import (EP_SIZES, GiB, WeightBytes, check_fit, fitting_ep_sizes, format_bytes,
                                         per_device_bytes, repack_fits, requests_at_length)
from deepinfer.loader.model_loader import weight_bytes
from deepinfer.models.registry import model_classes
from deepinfer.tools.make_checkpoint import PRESETS, checkpoint_config

GB = 10 ** 9
H200_FREE = 139 * GiB  # what torch.cuda.mem_get_info reports free on the lent H200, about


def _meta_model(raw: dict, quantized: bool = True):
    config_cls, model_cls = model_classes(raw["model_type"])
    with torch.device("meta"):
        return model_cls(config_cls.from_dict(raw), dtype=torch.bfloat16, quantized=quantized)


@pytest.fixture(scope="module")
def flash():
    """V4-Flash as shipped (FP8 blocks, FP4 routed experts, one MTP layer), no storage."""
    return _meta_model(checkpoint_config(PRESETS["flash"], "fp8"))


def test_per_device_bytes_splits_only_the_experts():
    w = WeightBytes(experts=100, other=30)
    assert per_device_bytes(w, 1, 5) == 135
    assert per_device_bytes(w, 4, 5) == 30 + 25 + 5
    assert per_device_bytes(w, 3, 0) == 30 + 34  # a share rounds up
    assert fitting_ep_sizes(w, 60, 5) == [4, 8, 16, 64]
    assert fitting_ep_sizes(w, 1000, 5) == list(EP_SIZES)
    assert fitting_ep_sizes(w, 30, 5) == []


def test_repacked_fp4_experts_count_twice_their_packed_codes():
    w = WeightBytes(experts=70, other=10, packed_fp4=64)  # 64 bytes of codes + 6 of scales
    assert w.serving(repack_fp4=False) == w
    assert w.serving(repack_fp4=True) == WeightBytes(experts=134, other=10)
    assert repack_fits(w, 134 + 10 + 5, 5) and not repack_fits(w, 134 + 10 + 4, 5)
    assert repack_fits(w, 67 + 10 + 5, 5, ep_size=2) and not repack_fits(w, 67 + 10 + 4, 5, ep_size=2)
    assert not repack_fits(WeightBytes(experts=70, other=10), 10 ** 9, 5)  # nothing packed: nothing to repack


@pytest.mark.parametrize("kw, field", [({"experts": -1, "other": 0}, "experts"),
                                       ({"experts": 0, "other": 1.5}, "other"),
                                       ({"experts": 4, "other": 0, "packed_fp4": 5}, "packed_fp4")])
def test_bad_weight_bytes_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        WeightBytes(**kw)


def test_bad_ep_size_names_the_field():
    with pytest.raises(ValueError, match="ep_size"):
        per_device_bytes(WeightBytes(1, 1), 0, 0)


def test_check_fit_passes_what_fits_and_names_figures_and_layouts_otherwise():
    w = WeightBytes(experts=80 * GiB, other=10 * GiB)
    check_fit(w, 100 * GiB, 10 * GiB, "cuda:0")  # exactly full: fits
    with pytest.raises(ValueError) as e:
        check_fit(w, 50 * GiB, 4 * GiB, "cuda:0 (H200)")
    msg = str(e.value)
    assert "cuda:0 (H200)" in msg and "94.00 GiB per GPU" in msg and "50.00 GiB is available" in msg
    assert "10.00 GiB non-expert" in msg and "80.00 GiB routed experts" in msg and "4.00 GiB cache" in msg
    # 2 GPUs: 10 + 40 + 4 = 54 > 50; 4 GPUs: 10 + 20 + 4 = 34
    assert "on 4 GPUs (34.00 GiB each), 8 GPUs" in msg and "2 GPUs" not in msg
    with pytest.raises(ValueError, match="even 64-way expert parallelism leaves 10.00 GiB"):
        check_fit(w, 12 * GiB, 4 * GiB, "cuda:0")


def test_requests_at_length_is_the_scarcer_of_slots_and_blocks():
    assert requests_at_length(8, {4: 100, 128: 10}, {4: 30, 128: 1}) == 3
    assert requests_at_length(2, {4: 100, 128: 10}, {4: 30, 128: 1}) == 2
    assert requests_at_length(8, {4: 100}, {4: 0}) == 8


def test_format_bytes():
    assert format_bytes(3 * GiB // 2) == "1.50 GiB" and format_bytes(5 << 20) == "5.0 MiB"


def test_weight_bytes_counts_every_tensor_once_and_sets_the_routed_experts_apart(flash):
    w = weight_bytes(flash)
    everything = sum(t.numel() * t.element_size() for t in [*flash.parameters(), *flash.buffers()])
    assert w.total == everything
    routed = sum(t.numel() * t.element_size() for n, t in flash.named_buffers() if ".ffn.experts." in n)
    assert w.experts == routed and w.experts > 0
    # the FP4 codes: E x (2 F x D/2 + D x F/2) bytes per MoE layer (main stack + MTP)
    c = flash.config
    layers = c.num_hidden_layers + c.num_nextn_predict_layers
    assert w.packed_fp4 == layers * c.n_routed_experts * 3 * c.moe_intermediate_size * c.hidden_size // 2


def test_v4_flash_as_shipped_is_about_its_released_size(flash):
    w = weight_bytes(flash)
    # released: ~160 GB; the -0731 shards 166.9 GB with three DSpark stages instead of one MTP layer
    assert 155 * GB < w.total < 165 * GB, w
    assert 145 * GB < w.experts < 155 * GB and 5 * GB < w.other < 12 * GB, w
    dense = weight_bytes(_meta_model(checkpoint_config(PRESETS["flash"], "fp8"), quantized=False))
    assert dense.total > 3.5 * w.total  # bf16 experts are 4x their FP4 codes


def test_v4_flash_does_not_fit_one_h200_and_the_error_names_the_ep_sizes_that_do(flash):
    reserve = 4 * GiB
    shipped = weight_bytes(flash)
    with pytest.raises(ValueError) as e:
        check_fit(shipped, H200_FREE, reserve, "cuda:0 (NVIDIA H200)")
    msg = str(e.value)
    need = float(re.search(r"needs ([\d.]+) GiB per GPU", msg).group(1))
    assert need == pytest.approx((shipped.total + reserve) / GiB, abs=0.01)
    assert "139.00 GiB is available" in msg
    assert "on 2 GPUs" in msg and "4 GPUs" in msg  # FP4 codes as shipped: ~75 GB of experts per GPU at EP2
    # the GPU path holds FP4 experts as FP8 codes once it has run (twice the packed bytes): EP2 no longer fits
    served = shipped.serving(repack_fp4=True)
    assert fitting_ep_sizes(served, H200_FREE, reserve) == [4, 8, 16, 64]


def test_v41_flash_backbone_with_host_engram_needs_expert_parallelism():
    net = _meta_model(PRESETS["flash41"])
    on_device, host = weight_bytes(net), weight_bytes(net, host_engram=True)
    engram = on_device.other - host.other
    assert 190 * GB < engram < 215 * GB  # the FP8 n-gram tables (~200 GB)
    assert host.experts == on_device.experts and 280 * GB < host.experts < 310 * GB
    assert fitting_ep_sizes(host, H200_FREE, 4 * GiB)[0] == 4  # ~148 GB of FP4 experts per GPU at EP2
