"""Engram hash + row lookup in one kernel: the torch reference is the layers' composition (ngram_rows +
EngramTable.lookup) and the kernel gives the reference's bits (interpreter and GPU)."""
import pytest
import torch

from deepinfer.kernels.engram_lookup import EngramQuery, engram_lookup, hash_rows, reference
from deepinfer.layers.engram import EngramTable
from deepinfer.layers.engram_hash import EngramHashParams, hash_constants, ngram_rows
from interpreter import interpreted_and_gpu

# Random windows: raw ids with -1 at random columns (blocking is cumulative whatever follows), hash constants
# from EngramHashParams (multipliers as large as the bound allows), FP8 tables with every finite e4m3 code
# and every E8M0 byte (2^-127 .. inf), dense bf16 / fp32 tables; out in bf16 and fp32.
SETUP = (
    "import torch\n"
    "from deepinfer.layers.engram_hash import EngramHashParams\n"
    "def case(g, K, n_heads, T, D, vocab=300, cvocab=170):\n"
    "    pad = int(torch.randint(0, cvocab, (1,), generator=g))\n"
    "    p = EngramHashParams.build([3, 7], [12000, 12000], K, n_heads, 40, cvocab, pad_id=pad)\n"
    "    e = int(torch.randint(0, 2, (1,), generator=g))\n"
    "    win = torch.randint(0, vocab, (T, K), generator=g)\n"
    "    win[torch.rand(T, K, generator=g) < 0.15] = -1\n"
    "    win[:3, 0] = -1\n"                                   # whole windows blocked
    "    tmap = torch.randint(0, cvocab, (vocab,), generator=g)\n"
    "    const = [torch.tensor(c[e]) for c in (p.multipliers, p.primes, p.offsets)]\n"
    "    return win, tmap, const, p.pad_id\n"
    "def fp8_table(g, rows, D, extreme):\n"
    "    codes = torch.randint(0, 256, (rows, D), generator=g, dtype=torch.int32)\n"
    "    codes[(codes & 0x7f) == 0x7f] = 0\n"                 # no NaN codes
    "    lo, hi = (0, 256) if extreme else (100, 140)\n"
    "    scale = torch.randint(lo, hi, (rows, D // 32), generator=g, dtype=torch.int32)\n"
    "    return codes.to(torch.uint8).view(torch.float8_e4m3fn), scale.to(torch.uint8).view(torch.float8_e8m0fnu)\n"
    "def same(a, b):\n"
    "    a, b = a.float(), b.float()\n"
    "    bits = (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())\n"
    "    return a.shape == b.shape and bool(bits.all())\n"
)

CHECK = SETUP + (
    "from deepinfer.kernels.engram_lookup import _launch, engram_lookup, reference\n"
    "g = torch.Generator().manual_seed(0)\n"
    "run = engram_lookup if DEV == 'cuda' else _launch\n"
    "n = 0\n"
    "for K in (2, 3, 4, 5):\n"
    "    for n_heads, D, table in ((1, 64, 'fp8'), (3, 96, 'fp8x'), (8, 512, 'fp8'), (2, 48, torch.bfloat16),\n"
    "                              (5, 64, torch.float32)):\n"
    "        win, tmap, const, pad = case(g, K, n_heads, 37, D)\n"
    "        if isinstance(table, str):\n"
    "            w, s = fp8_table(g, 12000, D, table == 'fp8x')\n"
    "        else:\n"
    "            w, s = (torch.randn(12000, D, generator=g) * 3).to(table), None\n"
    "        for dtype in (torch.bfloat16, torch.float32):\n"
    "            want = reference(win, tmap, *const, pad, w, s, dtype)\n"
    "            dev = lambda t: None if t is None else t.to(DEV)\n"
    "            got = run(dev(win), dev(tmap), *map(dev, const), pad, dev(w), dev(s), dtype)\n"
    "            assert got.dtype == dtype and same(got.cpu(), want), (K, n_heads, D, table, dtype)\n"
    "            n += 1\n"
    "empty = run(win[:0].to(DEV), tmap.to(DEV), *[c.to(DEV) for c in const], pad, w.to(DEV), None, torch.float32)\n"
    "assert empty.shape == (0, const[1].shape[0], w.shape[1])\n"
    "assert n == 40\n"
    "print('ok')\n")

# Triton 3.6's interpreter casts fp32 -> bf16 by truncation and mishandles bf16 subnormals; the compiled cast
# (cvt.rn.bf16.f32) rounds to nearest even like torch, so the interpreter run uses torch's cast.
BF16_CAST = (
    "import numpy as np, torch, triton.language as tl, triton.runtime.interpreter as ti\n"
    "_convert = ti._convert_float\n"
    "def _rne(x, src, dst, mode):\n"
    "    if src == tl.float32 and dst == tl.bfloat16:\n"
    "        return torch.from_numpy(np.ascontiguousarray(x).view(np.float32)).to(torch.bfloat16).view(torch.int16)"
    ".numpy().view(np.uint16)\n"
    "    return _convert(x, src, dst, mode)\n"
    "ti._convert_float = _rne\n")

test_kernel_in_the_triton_interpreter, test_kernel_on_gpu = interpreted_and_gpu(CHECK, BF16_CAST + "DEV = 'cpu'\n",
                                                                                "DEV = 'cuda'\n")

_ns = {}
exec(SETUP, _ns)


@pytest.mark.parametrize("K", [2, 3, 4, 5])
@pytest.mark.parametrize("fp8", [True, False])
def test_reference_is_ngram_rows_then_the_table_lookup(K, fp8):
    g = torch.Generator().manual_seed(K)
    p = EngramHashParams.build([3, 7], [4000, 4000], K, 3, 40, 170, pad_id=11)
    win = torch.randint(0, 300, (50, K), generator=g)
    win[torch.rand(50, K, generator=g) < 0.2] = -1
    tmap = torch.randint(0, 170, (300,), generator=g)
    rows = ngram_rows(win, p, token_map=tmap)
    mult, primes, offsets = hash_constants(p, win.device)
    table = EngramTable(4000, 64, torch.float32, fp8)
    if fp8:
        table.weight, table.scale = _ns["fp8_table"](g, 4000, 64, True)
    else:
        table.weight.data = torch.randn(4000, 64, generator=g)
    for e in range(2):
        for dtype in (torch.bfloat16, torch.float32):
            want = table.lookup(rows[:, e], dtype, win.device)
            got = reference(win, tmap, mult[e], primes[e], offsets[e], p.pad_id, table.weight, table.scale, dtype)
            assert _ns["same"](got, want)
            q = EngramQuery(win, tmap, mult[e], primes[e], offsets[e], p.pad_id)
            assert _ns["same"](q.lookup(table.weight, table.scale, dtype), want)  # CPU: the reference
            pick = torch.tensor([4, 0, 31])
            assert _ns["same"](q[pick].lookup(table.weight, table.scale, dtype), want[pick])


def test_products_cannot_overflow_int64():
    """Multipliers are bounded so that (compressed vocab - 1) * multiplier fits in int64."""
    for cvocab in (2, 170, 129_280, 2 ** 31):
        p = EngramHashParams.build([1], [10 ** 9], 5, 8, 1000, cvocab)
        assert max(p.multipliers[0]) * (cvocab - 1) < 2 ** 63


def test_cpu_uses_the_reference():
    g = torch.Generator().manual_seed(3)
    win, tmap, const, pad = _ns["case"](g, 3, 2, 9, 32)
    w = torch.randn(4000, 32, generator=g)
    assert torch.equal(engram_lookup(win, tmap, *const, pad, w, None, torch.float32),
                       reference(win, tmap, *const, pad, w, None, torch.float32))


def test_v41_step_context_hands_device_tables_the_windows():
    """A device-resident table gets each step's windows (image tokens blocked as -1) and its layer's hash
    constants; the reference then gives the host hashing's rows, and bounded replay's subset picks windows."""
    import dataclasses

    from deepinfer.models.config_v41 import DeepseekV41Config
    from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM
    from deepinfer.state.forward_batch import SeqChunk, build_forward_batch
    from deepinfer.tools.make_checkpoint import PRESETS

    cfg = dataclasses.replace(DeepseekV41Config.from_dict(PRESETS["tiny41"]), engram_compressed_vocab_size=300)
    model = DeepseekV41ForCausalLM(cfg)
    model.set_engram_vocab([(7 * i) % 300 for i in range(cfg.vocab_size)])
    g = torch.Generator().manual_seed(5)
    ids = lambda n: torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    chunks = [SeqChunk(0, 0, ids(9), image_spans=[(2, 3)]), SeqChunk(1, 6, ids(4), prev_tokens=ids(6),
                                                                        image_spans=[(4, 3)])]
    b = build_forward_batch(chunks, cfg.sliding_window, set(), 16, "cpu", model.token_history)
    assert b.window_mask is not None and not b.window_mask.all()
    ctx = model.step_context(b)
    want = ngram_rows(b.token_windows, model.engram_params, token_map=model.engram_token_map, mask=b.window_mask)
    assert len(ctx.engram_rows) == len(cfg.engram_layer_ids)
    for e, q in enumerate(ctx.engram_rows):
        assert isinstance(q, EngramQuery)
        assert torch.equal(hash_rows(q.windows, q.token_map, q.multipliers, q.primes, q.offsets, q.pad_id),
                           want[:, e])
    keep = torch.tensor([1, 4, 10, 12])
    sub = ctx.subset(keep, b)
    assert all(torch.equal(s.windows, q.windows[keep]) for s, q in zip(sub.engram_rows, ctx.engram_rows))
