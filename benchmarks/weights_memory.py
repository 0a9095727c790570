"""What `LLM` holds for the weights of a FP8/FP4 checkpoint, measured: V4-Flash and V4.1-Flash at their
released widths with 2 layers, written in the released layout (FP8 blocks, FP4 routed experts) by the
project's own writer (deepinfer.tools.make_checkpoint.write_checkpoint) to a temporary directory, then
loaded on the GPU twice, one LLM at a time (freed before the next):

- `quantization=None`: the checkpoint's formats kept (the CUDA default);
- `quantization="none"`: every weight dequantised to bf16.

Each row: torch.cuda.memory_allocated growth across load_model (deepinfer.llm's, wrapped, as
tests/engine/test_quantization.py measures it), the tensor bytes in the safetensors shards (headers
left out), the same model's bytes in bf16 (the model built unquantised on the meta device), and
weight_bytes' breakdown (routed experts / everything else / packed FP4) right after load_model and
after LLM's start-up: on CUDA with bf16 activations LLM rewrites FP4 routed experts as FP8 codes
where that copy fits (twice the codes' bytes, the faster kernel); its growth is measured too.

The reduced models (CONFIGS says exactly what): 2 layers, no draft layers, no vision tower, and
--experts routed experts per layer (default 8, not 256 / 384): the writer draws every value with
torch's single-threaded CPU generator (~6.6 ns per element) and quantises on the CPU, so a released
layer's experts alone (6.4 G values for V4, 13.6 G for V4.1) would take minutes to write. The
widths (hidden, heads, head dim, LoRA ranks, expert width, vocabulary) are the released ones. Both
checkpoints are written at once in two child processes, V4.1's while V4 is measured.

    cd benchmarks && PYTHONPATH=.. python weights_memory.py --commit <hash> --out $OUT/wm.json
    python benchmarks/weights_memory.py --smoke   # tiny / tiny41 on the CPU; writes under a temporary directory
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from concurrent.futures import Future, ProcessPoolExecutor
from datetime import date
from multiprocessing import get_context
from pathlib import Path

import torch

from common import add_commit_arg, new_results_path, recorded_commit, refuse_existing_out

LAYERS = 2
# V4: layer 0 CSA (ratio 4: compressor + indexer) with hash routing, layer 1 HCA (ratio 128) with
# top-k routing: every tensor kind of a V4 block in two layers
V4_LAYERS = {"num_hidden_layers": LAYERS, "compress_ratios": [4, 128], "num_hash_layers": 1,
             "num_nextn_predict_layers": 0}
# V4.1: layer 0 SWA, layer 1 Full ratio-2 KV / index / candidate source with the Engram table: every
# tensor kind of a V4.1 block in two layers
V41_LAYERS = {"num_hidden_layers": LAYERS, "compress_ratios": [0, 2], "kv_source_layer_ids": [1],
              "index_source_layer_ids": [1], "candidate_source_layer_id": 1}
# the Engram table's hash primes start here instead of at 16e6: ~24 x this many rows (256-wide FP8),
# 62 MB instead of 98 GB; the row format is the released one
ENGRAM_VOCAB = 10_000
PRESETS = {"full": {"v4": "flash", "v41": "flash41"}, "smoke": {"v4": "tiny", "v41": "tiny41"}}
CONFIGS = {
    "v4": f"the preset with {V4_LAYERS}, n_routed_experts = --experts",
    "v41": f"presets_v41.slice41_preset(preset, engram_vocab_size=min(its own, {ENGRAM_VOCAB})) with "
           f"{V41_LAYERS}, n_routed_experts = --experts (no draft stages, no vision tower)",
}


def model_config(arch: str, preset: str, experts: int) -> dict:
    """The config dict written for `arch` at `preset`'s widths (CONFIGS says what is reduced)."""
    from deepinfer.tools.make_checkpoint import PRESETS as ALL
    from deepinfer.tools.presets_v41 import slice41_preset

    if arch == "v4":
        return {**ALL[preset], **V4_LAYERS, "n_routed_experts": experts}
    vocab = min(ALL[preset]["text_config"]["engram_vocab_size"], ENGRAM_VOCAB)
    top = slice41_preset(preset, engram_vocab_size=vocab)
    top["text_config"] = {**top["text_config"], **V41_LAYERS, "n_routed_experts": experts}
    return top


def write(config: dict, out_dir: str, threads: int) -> tuple[str, float]:
    """The checkpoint in the released layout (fp8: FP8 blocks, FP4 routed experts); (dir, seconds)."""
    from deepinfer.tools.make_checkpoint import write_checkpoint

    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    write_checkpoint(out_dir, config, seed=0, dtype="fp8")
    return out_dir, time.perf_counter() - t0


def _breakdown(net) -> dict:
    from deepinfer.loader.model_loader import weight_bytes

    w = weight_bytes(net)
    return {"total": w.total, "experts": w.experts, "other": w.other, "packed_fp4": w.packed_fp4}


def _allocated(device: str) -> int:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    return 0


def measure(path: Path, quantization: str | None, device: str) -> dict:
    """One LLM on `path`: the allocator's growth across load_model (CUDA), weight_bytes after load_model
    and after start-up, the growth across the FP4 -> FP8-code rewrite where LLM made it; then the LLM is
    freed and what it left allocated is measured."""
    import deepinfer.executor.worker as llm_module  # where the engine's rank loads and repacks its model
    from deepinfer import LLM

    seen: dict = {}
    load, repack = llm_module.load_model, llm_module.repack_fp4_experts

    def measured_load(*a, **k):
        before = _allocated(device)
        t0 = time.perf_counter()
        net, model_dir = load(*a, **k)
        seen["grew"] = _allocated(device) - before
        seen["load_s"] = round(time.perf_counter() - t0, 2)
        seen["loaded"] = _breakdown(net)
        return net, model_dir

    def measured_repack(net, **k):
        before = _allocated(device)
        repack(net, **k)
        seen["repack_grew"] = _allocated(device) - before

    base = _allocated(device)
    llm_module.load_model, llm_module.repack_fp4_experts = measured_load, measured_repack
    try:
        llm = LLM(str(path), device=device, quantization=quantization, kv_cache_memory=64 << 20,
                  max_model_len=1024, max_num_seqs=2, enforce_eager=True, skip_tokenizer_init=True,
                  kv_cache_dtype="auto" if device.startswith("cuda") else "bfloat16")
    finally:
        llm_module.load_model, llm_module.repack_fp4_experts = load, repack
    out = {"keeps_formats": llm.config.keeps_checkpoint_formats, "loaded": seen["loaded"],
           "held": _breakdown(llm.model), "load_s": seen["load_s"]}
    if device.startswith("cuda"):
        out["allocated_bytes"] = seen["grew"]
        out["allocated_source"] = "torch.cuda.memory_allocated growth across load_model"
        out["repack_allocated_bytes"] = seen.get("repack_grew")  # None: LLM kept the FP4 codes packed
    else:
        out["allocated_bytes"] = seen["loaded"]["total"]
        out["allocated_source"] = "weight_bytes total after load_model (CPU: no allocator counter to read)"
    llm.close()
    del llm
    gc.unfreeze()  # LLM freezes its start-up heap out of the collector's reach
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        out["left_allocated_after_free"] = _allocated(device) - base
    return out


def rows_for(arch: str, preset: str, experts: int, path: Path, write_s: float, device: str) -> list[dict]:
    from deepinfer.engine.memory_fit import format_bytes
    from deepinfer.loader.checkpoint import tensor_bytes_on_disk
    from deepinfer.loader.model_loader import meta_model, weight_bytes

    disk = tensor_bytes_on_disk(path)
    bf16 = weight_bytes(meta_model(path, dtype=torch.bfloat16, quantized=False)).total
    kept = None if device.startswith("cuda") else "fp8"  # the CPU default dequantises
    rows = []
    for q in (kept, "none"):
        m = measure(path, q, device)
        rows.append({"arch": arch, "preset": preset, "layers": LAYERS, "n_routed_experts": experts,
                     "quantization": q, "keeps_formats": m.pop("keeps_formats"),
                     "allocated_bytes": m["allocated_bytes"], "disk_bytes": disk, "bf16_equiv_bytes": bf16,
                     "ratio_to_disk": round(m["allocated_bytes"] / disk, 4),
                     "ratio_to_bf16": round(m["allocated_bytes"] / bf16, 4), "write_s": round(write_s, 1), **m})
        r = rows[-1]
        print(f"{arch} {preset} x{LAYERS} layers, {experts} experts, quantization={q!r}: allocated "
              f"{format_bytes(r['allocated_bytes'])}, disk {format_bytes(disk)}, bf16 {format_bytes(bf16)}: "
              f"x{r['ratio_to_disk']} of disk, x{r['ratio_to_bf16']} of bf16; held after start-up "
              f"{format_bytes(r['held']['total'])} (routed experts {format_bytes(r['held']['experts'])}); "
              f"load {r['load_s']} s", flush=True)
    return rows


def results_path(out: str | None, smoke: bool, device: str) -> Path:
    """`out`, else benchmarks/results/<date>-<device>-weights-memory.json; a smoke run never writes into
    the tracked results directory (a fresh temporary directory instead)."""
    if out:
        return Path(out)
    folder = Path(tempfile.mkdtemp(prefix="weights-memory-smoke-")) if smoke else Path(__file__).parent / "results"
    return new_results_path(folder / f"{date.today()}-{device.replace(' ', '-')}-weights-memory.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8, help="routed experts per layer (released: 256 / 384)")
    ap.add_argument("--archs", default="v4,v41")
    ap.add_argument("--device", default=None, help="default: cuda (the smoke run: cpu)")
    ap.add_argument("--workdir", default=None, help="where the checkpoints are written (default: the temp dir)")
    ap.add_argument("--out", default=None)
    add_commit_arg(ap)
    ap.add_argument("--smoke", action="store_true", help="tiny / tiny41 widths on the CPU, one process")
    args = ap.parse_args()
    refuse_existing_out(args)
    archs = args.archs.split(",")
    if not archs or any(a not in PRESETS["full"] for a in archs):
        raise SystemExit(f"--archs: one or more of {', '.join(PRESETS['full'])}, got {args.archs!r}")
    device = args.device or ("cpu" if args.smoke else "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch sees no CUDA device (use --smoke or --device cpu)")
    presets = PRESETS["smoke" if args.smoke else "full"]
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    out = results_path(args.out, args.smoke, "cpu-smoke" if args.smoke else name)
    result = {"device": name, "date": str(date.today()), "commit": recorded_commit(args),
              "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]), "configs": CONFIGS, "rows": []}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="weights-memory-", dir=args.workdir) as tmp:
        configs = {a: model_config(a, presets[a], args.experts) for a in archs}
        dirs = {a: str(Path(tmp) / a) for a in archs}
        # non-smoke: both written at once in child processes (the writer's random draws are single-threaded)
        pool = None if args.smoke else ProcessPoolExecutor(len(archs), mp_context=get_context("spawn"))
        try:
            if pool is None:
                written = {a: write(configs[a], dirs[a], 0) for a in archs}
            else:
                threads = max(1, (os.cpu_count() or 2) // len(archs))
                written = {a: pool.submit(write, configs[a], dirs[a], threads) for a in archs}
            for a in archs:
                got = written[a]
                path, write_s = got.result() if isinstance(got, Future) else got
                print(f"{a}: wrote {presets[a]} x{LAYERS} layers in {write_s:.1f} s", flush=True)
                result["rows"] += rows_for(a, presets[a], args.experts, Path(path), write_s, device)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(result, indent=2) + "\n")  # after every arch: a cut-off run keeps its rows
                shutil.rmtree(path)  # disk for the next one
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
