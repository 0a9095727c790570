"""LLM(quantization=...): FP8 block weights and FP4 routed experts kept as shipped or dequantised, the
start-up figures, the memory-fit check before any weight is read, and the parallel sizes this build
turns down."""
from __future__ import annotations

import gc
import logging
import re
from types import SimpleNamespace

import pytest
import torch

import deepinfer.loader.model_loader as model_loader
from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.memory_fit import WORKSPACE_BYTES
from deepinfer.layers.linear import Linear
from deepinfer.layers.moe import Experts
from deepinfer.loader.checkpoint import tensor_bytes_on_disk
from deepinfer.loader.model_loader import weight_bytes
from deepinfer.tools.make_checkpoint import PRESETS, write_checkpoint

CFG = PRESETS["tiny"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=3)
PROMPTS = [[0, 5, 9, 33, 70, 12, 401], [0, 44, 45, 46]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("quant") / "ckpt", CFG, seed=3, dtype="fp8")


def _llm(path, **kw) -> LLM:
    kw = {"device": "cpu", "dtype": "float32", "kv_cache_dtype": "float32", "kv_cache_memory": 16 << 20,
          "skip_tokenizer_init": True, **kw}
    return LLM(str(path), **kw)


def _experts(llm: LLM) -> list[Experts]:
    return [m for m in llm.model.modules() if isinstance(m, Experts)]


def _linears(llm: LLM) -> list[Linear]:
    return [m for m in llm.model.modules() if isinstance(m, Linear)]


@pytest.fixture(scope="module")
def kept(ckpt):
    """bf16, the checkpoint's dtype for what is not quantised."""
    return _llm(ckpt, quantization="fp8", dtype="bfloat16", kv_cache_dtype="bfloat16")


@pytest.fixture(scope="module")
def dequantised(ckpt):
    return _llm(ckpt, quantization="none")


def test_fp8_keeps_the_shipped_formats_at_their_size_on_disk(ckpt, kept):
    experts = _experts(kept)
    assert experts and all(e.w1.dtype == torch.int8 and e.w1_scale.dtype == torch.float8_e8m0fnu for e in experts)
    c = kept.model.config
    assert experts[0].w1.shape == (c.n_routed_experts, c.moe_intermediate_size, c.hidden_size // 2)  # 2 codes/byte
    fp8 = [m for m in _linears(kept) if m.weight.dtype == torch.float8_e4m3fn]
    assert fp8 and all(m.scale.dtype == torch.float8_e8m0fnu for m in fp8)
    held, disk = weight_bytes(kept.model), tensor_bytes_on_disk(ckpt)
    assert abs(held.total - disk) < 0.03 * disk, (held, disk)
    # the same checkpoint dequantised to bf16: FP4 experts take 4x their codes
    bf16 = weight_bytes(_llm(ckpt, quantization="none", dtype="bfloat16", kv_cache_dtype="bfloat16").model)
    assert held.experts < 0.3 * bf16.experts and held.total < 0.6 * bf16.total, (held, bf16)


def test_load_model_prepares_the_fp8_linears_once_the_weights_are_in(ckpt, monkeypatch):
    """load_model hands the loaded model to prepare_fp8_linears (fp32 W8A8 scales and the cuBLAS probe on a
    GPU); on the CPU that leaves every Linear's scale_fp32 unset."""
    seen = []
    real = model_loader.prepare_fp8_linears

    def spy(model):
        seen.append(sum(1 for m in model.modules() if isinstance(m, Linear) and m.block_size is not None))
        real(model)

    monkeypatch.setattr(model_loader, "prepare_fp8_linears", spy)
    llm = _llm(ckpt, quantization="fp8", dtype="bfloat16", kv_cache_dtype="bfloat16")
    assert len(seen) == 1 and seen[0] > 0                              # once, with the FP8 Linears in it
    assert all(m.scale_fp32 is None for m in _linears(llm))


def test_none_dequantises_every_weight_to_the_dtype(dequantised):
    assert all(m.weight.dtype == torch.float32 and m.block_size is None for m in _linears(dequantised))
    assert all(e.w1.dtype == torch.float32 and not hasattr(e, "w1_scale") for e in _experts(dequantised))
    assert not [n for n, _ in dequantised.model.named_buffers() if n.endswith("scale")]


def test_the_cpu_default_is_the_dequantised_reference(ckpt, dequantised):
    default = _llm(ckpt)
    assert default.config.quantization is None and not default.config.keeps_checkpoint_formats
    assert weight_bytes(default.model) == weight_bytes(dequantised.model)
    assert EngineConfig(device="cuda:1").keeps_checkpoint_formats  # CUDA keeps what the checkpoint ships
    assert not EngineConfig(device="cuda", quantization="none").keeps_checkpoint_formats
    assert EngineConfig(device="cpu", quantization="fp8").keeps_checkpoint_formats


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kept_and_dequantised_weights_give_the_same_tokens_and_logprobs(ckpt, dtype):
    """On the CPU a quantised layer dequantises its weight and runs the same dense GEMM: e4m3 codes (and
    e2m1 ones) times E8M0 powers of two are exact in bf16 and fp32, so both models multiply by the same
    values in the same order, and the outputs are bitwise equal (not merely close)."""
    kv = "float32" if dtype == "float32" else "bfloat16"
    outs = [_llm(ckpt, quantization=q, dtype=dtype, kv_cache_dtype=kv).generate(PROMPTS, GREEDY, use_tqdm=False)
            for q in ("fp8", "none")]
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("value", ["int4", "FP8", "bf16", ""])
def test_an_unknown_quantization_names_the_field(ckpt, value):
    with pytest.raises(ValueError, match="quantization"):
        _llm(ckpt, quantization=value)


def _no_weight_reads(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a weight was read before the check")
    monkeypatch.setattr(model_loader, "load_weights", refuse)


def test_fp8_on_an_unquantised_checkpoint_is_refused_before_any_weight_is_read(tmp_path, monkeypatch):
    bf16 = write_checkpoint(tmp_path / "bf16", CFG, seed=3, dtype="bfloat16")
    _no_weight_reads(monkeypatch)
    with pytest.raises(ValueError, match="quantization: 'fp8'.*no quantization_config"):
        _llm(bf16, quantization="fp8")


def test_the_default_on_an_unquantised_checkpoint_loads_it_as_it_is(tmp_path):
    bf16 = write_checkpoint(tmp_path / "bf16", CFG, seed=3, dtype="bfloat16")
    llm = _llm(bf16, dtype="bfloat16", kv_cache_dtype="bfloat16")
    assert all(m.weight.dtype == torch.bfloat16 for m in _linears(llm))


def _fake_gpu(monkeypatch, free: int) -> None:
    """A CUDA device as far as the fit check asks (no CUDA call is made before it refuses)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")


def test_a_model_that_does_not_fit_the_gpu_is_refused_before_any_weight_is_read(ckpt, kept, monkeypatch):
    served = weight_bytes(kept.model).serving(repack_fp4=True)  # FP4 experts as FP8 codes (where they fit)
    kv = 1 << 20
    _no_weight_reads(monkeypatch)
    # room for the reserve, the non-expert weights and half the experts: EP2 fits exactly, one GPU does not
    _fake_gpu(monkeypatch, free=WORKSPACE_BYTES + kv + served.other + served.experts // 2)
    with pytest.raises(ValueError) as e:
        LLM(str(ckpt), device="cuda", kv_cache_memory=kv, skip_tokenizer_init=True)
    msg = str(e.value)
    assert "does not fit cuda (Fake GPU)" in msg and "GiB is available" in msg and "GiB per GPU" in msg
    assert re.search(r"would fit on 2 GPUs .* 64 GPUs", msg), msg


def test_a_v41_model_that_does_not_fit_names_the_host_engram_tables(tmp_path, monkeypatch):
    ckpt41 = write_checkpoint(tmp_path / "v41", PRESETS["tiny41"], seed=3, dtype="fp8")
    _no_weight_reads(monkeypatch)
    _fake_gpu(monkeypatch, free=1 << 20)
    with pytest.raises(ValueError, match=r"does not fit .* engram_device='cpu' keeps the [\d.]+ MiB of Engram"):
        LLM(str(ckpt41), device="cuda", kv_cache_memory=1 << 20, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="does not fit") as e:
        LLM(str(ckpt41), device="cuda", kv_cache_memory=1 << 20, skip_tokenizer_init=True, engram_device="cpu")
    assert "Engram" not in str(e.value)


def test_the_fit_check_counts_the_model_with_its_quantization(ckpt, monkeypatch):
    seen = []
    monkeypatch.setattr("deepinfer.llm.check_fit", lambda w, free, reserve, where: seen.append(w) or
                        (_ for _ in ()).throw(ValueError("stop")))
    _fake_gpu(monkeypatch, free=1 << 40)
    for q in ("fp8", "none"):
        with pytest.raises(ValueError, match="stop"):
            LLM(str(ckpt), device="cuda", quantization=q, skip_tokenizer_init=True)
    shipped = weight_bytes(_llm(ckpt, quantization="fp8", dtype="bfloat16", kv_cache_dtype="bfloat16").model)
    dense = weight_bytes(_llm(ckpt, quantization="none", dtype="bfloat16", kv_cache_dtype="bfloat16").model)
    assert seen == [shipped, dense]  # as shipped: the FP8-code copy of the FP4 experts is optional


@pytest.mark.parametrize("kw, named", [({"enable_expert_parallel": True}, "needs data_parallel_size > 1"),
                                       ({"enable_expert_parallel": True, "enable_eplb": True}, "needs data_parallel_size > 1"),
                                       ({"data_parallel_size": 2, "tensor_parallel_size": 2,
                                         "enable_expert_parallel": True}, "tensor_parallel_size=2"),
                                       ({"data_parallel_size": 2, "context_parallel_size": 2,
                                         "enable_expert_parallel": True}, "context_parallel_size=2"),
                                       ({"tensor_parallel_size": 2, "engram_device": "cpu"}, "engram_device")])
def test_layouts_not_built_are_refused_by_name(ckpt, monkeypatch, kw, named):
    """Expert parallelism without data-parallel ranks or beside tensor / context parallelism, host Engram tables
    with several ranks: refused by name before any weight is read (every combination of the three sizes runs)."""
    _no_weight_reads(monkeypatch)
    with pytest.raises(ValueError, match=named) as e:
        _llm(ckpt, **kw)
    assert str(e.value).startswith(("enable_expert_parallel: ", "engram_device: ")), str(e.value)


@pytest.mark.parametrize("kw, field", [({"tensor_parallel_size": 0}, "tensor_parallel_size"),
                                       ({"data_parallel_size": -2}, "data_parallel_size"),
                                       ({"context_parallel_size": 1.5}, "context_parallel_size"),
                                       ({"tensor_parallel_size": True}, "tensor_parallel_size"),
                                       ({"enable_expert_parallel": "yes"}, "enable_expert_parallel"),
                                       ({"enable_eplb": True}, "enable_eplb.*enable_expert_parallel"),
                                       ({"eplb_config": {"window_size": 4}}, "eplb_config: given without enable_eplb"),
                                       ({"eplb_config": {"step_interval": 0}, "enable_eplb": True,
                                         "enable_expert_parallel": True}, r"eplb_config\.step_interval"),
                                       ({"eplb_config": {"log_balancedness": True}, "enable_eplb": True,
                                         "enable_expert_parallel": True}, r"eplb_config: unknown key"),
                                       ({"eplb_config": [1], "enable_eplb": True,
                                         "enable_expert_parallel": True}, "eplb_config: expected a dict")])
def test_bad_parallel_sizes_name_the_field(ckpt, kw, field):
    with pytest.raises(ValueError, match=field):
        _llm(ckpt, **kw)


def _figure(messages: list[str], pattern: str) -> str:
    found = [m for m in messages if re.search(pattern, m)]
    assert len(found) == 1, messages
    return found[0]


def _to_bytes(value: str, unit: str) -> float:
    return float(value) * {"GiB": 1 << 30, "MiB": 1 << 20}[unit]


def test_the_startup_log_gives_weights_cache_and_requests_that_fit(ckpt, caplog):
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        llm = _llm(ckpt, quantization="fp8", dtype="bfloat16", kv_cache_dtype="bfloat16", max_model_len=256,
                   max_num_seqs=64, kv_cache_memory=3 << 20)
    said = [r.getMessage() for r in caplog.records if r.name.startswith("deepinfer")]
    w = re.search(r"weights: ([\d.]+) (MiB|GiB) on cpu \(as the checkpoint stores them",
                  _figure(said, r"^weights: "))
    assert _to_bytes(*w.groups()) == pytest.approx(tensor_bytes_on_disk(ckpt), rel=0.05)
    line = _figure(said, r"^cache: ")
    c = re.search(r"cache: ([\d.]+) (MiB|GiB) \((\d+) request slots\); (\d+) request\(s\) of max_model_len=256", line)
    cache = llm.engine.core.runner.cache
    held = sum(t.nbytes() for t in cache.layers + cache.mtp)
    assert _to_bytes(*c.groups()[:2]) == pytest.approx(held, abs=0.05 * (1 << 20))  # one decimal of MiB
    assert int(c.group(3)) == llm.scheduler.kv.num_slots
    fit = int(c.group(4))
    # that many requests of max_model_len tokens can be held at once, and one more cannot
    kv = KVCacheManager(llm.scheduler.kv.num_slots, llm.scheduler.kv.num_blocks, llm.scheduler.kv.block_size)
    reqs = [SimpleNamespace(slot=None, block_tables={}) for _ in range(fit + 1)]
    assert 0 < fit < 64 and all(kv.allocate(r, 256) for r in reqs[:fit])
    assert not kv.allocate(reqs[fit], 256)


@pytest.mark.gpu
def test_on_cuda_the_weights_take_their_shipped_bytes(ckpt, monkeypatch):
    """LLM on a FP8/FP4 checkpoint holds the weights at their size on disk (torch.cuda.memory_allocated
    across load_model), not at their bf16 size."""
    import deepinfer.executor.worker as worker_module  # where LLM's engine loads a one-rank model

    grew = []

    def measured(*a, **k):
        gc.collect()  # an earlier test's unreachable tensors (same pytest worker) must not be freed inside the window
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = model_loader.load_model(*a, **k)
        torch.cuda.synchronize()
        grew.append(torch.cuda.memory_allocated() - before)
        return out

    monkeypatch.setattr(worker_module, "load_model", measured)
    llm = LLM(str(ckpt), device="cuda", kv_cache_memory=64 << 20, skip_tokenizer_init=True)
    disk, tensors = tensor_bytes_on_disk(ckpt), sum(1 for _ in [*llm.model.parameters(), *llm.model.buffers()])
    assert llm.config.keeps_checkpoint_formats
    assert abs(grew[0] - disk) <= 0.05 * disk + 512 * tensors, (grew, disk)  # the allocator rounds to 512 B
    dense = weight_bytes(_llm(ckpt, quantization="none", dtype="bfloat16", kv_cache_dtype="bfloat16").model)
    assert grew[0] < 0.7 * dense.total
    # this tiny model fits many times over: its FP4 experts were rewritten as FP8 codes after loading
    # (the faster kernel), and serving holds that size, no more
    # (their E8M0 scales folded from (1, 32) to (1, 128) where exact: at most 3/4 of the scale bytes less)
    shipped = weight_bytes(_llm(ckpt, quantization="fp8", dtype="bfloat16", kv_cache_dtype="bfloat16").model)
    bound = shipped.serving(repack_fp4=True)
    scale_bytes = shipped.packed_fp4 * 2 // 32  # one E8M0 byte per 32 weights, two weights a packed byte

    def held_as_served():
        held = weight_bytes(llm.model)
        assert held.other == bound.other
        assert bound.experts - scale_bytes * 3 // 4 <= held.experts <= bound.experts, (held, bound)

    held_as_served()
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in out)
    held_as_served()


@pytest.mark.parametrize("room, repacked", [("repacked", True), ("shipped", False)])
def test_fp4_experts_are_held_as_fp8_codes_only_where_that_fits(ckpt, kept, monkeypatch, room, repacked):
    """bf16 on CUDA: the faster FP8-code copy of the FP4 experts (twice their codes' bytes) where it fits
    the GPU beside the reserve, the packed codes as shipped where only they fit."""
    from deepinfer import llm as llm_module
    from deepinfer.engine.memory_fit import per_device_bytes

    cfg = EngineConfig(device="cuda", dtype="bfloat16", kv_cache_memory=1 << 20)
    shipped = weight_bytes(kept.model)
    reserve = llm_module._fit_reserve(cfg, kept.model.config)
    free = per_device_bytes(shipped.serving(repack_fp4=room == "repacked"), 1, reserve)
    _fake_gpu(monkeypatch, free=free)
    assert shipped.packed_fp4 > 0
    assert llm_module._check_before_load(cfg, kept.model) is repacked
    assert llm_module._check_before_load(EngineConfig(device="cuda", dtype="float32", kv_cache_memory=1 << 20),
                                         kept.model) is False  # fp32 activations take the dequantising path


@pytest.mark.parametrize("kw, split", [({"data_parallel_size": 2, "enable_expert_parallel": True}, " / 2 routed"),
                                       ({"tensor_parallel_size": 2}, " / 2 routed"),
                                       ({"context_parallel_size": 2}, " routed")])
def test_a_parallel_layout_that_does_not_fit_is_refused_before_any_rank_starts(ckpt, kept, monkeypatch, kw, split):
    """The ranks' share of the model is checked on the least free GPU they take, before spawning."""
    from deepinfer.executor import multiproc

    def no_spawn(*a, **k):
        raise AssertionError("a rank was started before the check")
    monkeypatch.setattr(multiproc.MultiprocExecutor, "__init__", no_spawn)
    _no_weight_reads(monkeypatch)
    _fake_gpu(monkeypatch, free=1 << 20)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="does not fit cuda:0 .*least free of 2 GPU") as e:
        _llm(ckpt, device="cuda", dtype="bfloat16", kv_cache_dtype="bfloat16", **kw)
    msg = str(e.value)
    assert all(f"{k}={v!r}" in msg for k, v in kw.items()) and split in msg and "per GPU" in msg
