"""Writes docs/benchmarks.md from the results files in benchmarks/results/.

    python benchmarks/make_docs.py           # rewrite docs/benchmarks.md
    python benchmarks/make_docs.py --check   # exit 1 (and say where) if docs/benchmarks.md is not what the results give

Every table is declared in SECTIONS: which results file, which JSON path each cell reads, the row labels. No
measured number is typed in this script: a cell is read from its row's file, and a ratio is computed from two cells
of that same file (one run). A path is dotted keys with list filters: `rows[engine=deepinfer,batch=4].step_ms`
picks the one element of `rows` whose fields match; `Sum` adds every match. Each table's caption names its files
with the commit and device they record.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
DOC = REPO / "docs" / "benchmarks.md"


# ---- sources: a results file read as a dict ----

@dataclass(frozen=True)
class Json:
    file: str
    device: str | None = None  # only where the file names no device

    def load(self) -> dict:
        return json.loads((RESULTS / self.file).read_text())


@dataclass(frozen=True)
class Lines:
    """A text results file: `line` (named groups) parses each row, `commit` the commit from its header."""
    file: str
    line: str
    commit: str
    device: str

    def load(self) -> dict:
        text = (RESULTS / self.file).read_text()
        found = re.search(self.commit, text, re.M)
        rows = [{k: _number(v) for k, v in m.groupdict().items()} for m in re.finditer(self.line, text, re.M)]
        if not found or not rows:
            raise ValueError(f"{self.file}: no commit or no rows matched")
        return {"commit": found.group(1), "rows": rows}


@dataclass(frozen=True)
class ServeLog:
    """The vLLM-style result tables that `deepinfer bench serve` prints, as rows keyed by their labels, with the
    run's model and max concurrency from the line above each table and the commit from the log's COMMIT=."""
    file: str
    device: str

    def load(self) -> dict:
        text = (RESULTS / self.file).read_text()
        commit = re.search(r"COMMIT=([0-9a-f]{7,40})", text)
        rows = []
        tables = re.findall(r"^bench serve: ([^\n]*)\n=+ Serving Benchmark Result =+\n(.*?)^=+$", text, re.M | re.S)
        for head, body in tables:
            row = {"model": re.search(r"\(model (\S+?),", head).group(1),
                   "max_concurrency": int(re.search(r"max concurrency (\d+)", head).group(1))}
            row.update({k.strip(): _number(v.strip()) for k, v in re.findall(r"^([^:\n]+):\s+(\S+)\s*$", body, re.M)})
            rows.append(row)
        if not commit or not rows:
            raise ValueError(f"{self.file}: no COMMIT= or no result tables")
        return {"commit": commit.group(1), "rows": rows}


def _number(text: str):
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


# ---- cells ----

@dataclass(frozen=True)
class V:
    """The value at `path`, formatted with `fmt` after multiplying by `scale`; `null` shows `none`."""
    path: str
    fmt: str = "{}"
    scale: float = 1.0
    none: str | None = None

    def value(self, doc: dict):
        return _one(resolve(doc, self.path), self.path)

    def render(self, doc: dict) -> str:
        v = self.value(doc)
        if v is None:
            if self.none is None:
                raise ValueError(f"{self.path}: null")
            return self.none
        if isinstance(v, bool):
            return "yes" if v else "no"
        return self.fmt.format(v * self.scale if isinstance(v, (int, float)) and self.scale != 1 else v)


@dataclass(frozen=True)
class Sum(V):
    """The sum of every value `path` matches."""

    def value(self, doc: dict):
        vals = resolve(doc, self.path)
        if not vals or any(v is None for v in vals):
            raise ValueError(f"{self.path}: nothing to sum")
        return sum(vals)


@dataclass(frozen=True)
class Count(V):
    """How many elements `path` matches."""

    def value(self, doc: dict):
        return len(resolve(doc, self.path))


@dataclass(frozen=True)
class Ratio:
    """num / den, two cells of the same file; `loss=True` gives 1 - num / den."""
    num: V
    den: V
    fmt: str = "{:.2f}x"
    loss: bool = False

    def render(self, doc: dict) -> str:
        a, b = self.num.value(doc), self.den.value(doc)
        if a is None or b is None:
            return ""
        r = a / b
        return self.fmt.format(1 - r if self.loss else r)


@dataclass(frozen=True)
class Pair:
    """Two cells of the same file in one column, joined by `sep`."""
    a: V
    b: V
    sep: str = " / "

    def render(self, doc: dict) -> str:
        return self.a.render(doc) + self.sep + self.b.render(doc)


@dataclass(frozen=True)
class T:
    """Literal text (no measurement)."""
    text: str

    def render(self, doc: dict) -> str:
        return self.text


def resolve(doc, path: str) -> list:
    """Every value `path` reaches in `doc` (see the module docstring)."""
    vals = [doc]
    for key, filt in re.findall(r"([^.\[\]]+)?(\[[^\]]*\])?\.?", path):
        if key:
            vals = [v[key] for v in vals if isinstance(v, dict) and key in v]
        if filt:
            want = [(k, _parse(v)) for k, v in re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|[^,\]]*)', filt)]
            vals = [e for v in vals for e in v if all(isinstance(e, dict) and k in e and e[k] == x for k, x in want)]
    return vals


def _parse(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _one(vals: list, path: str):
    if len(vals) != 1:
        raise ValueError(f"{path}: {len(vals)} matches, want 1")
    return vals[0]


# ---- tables and sections ----

@dataclass(frozen=True)
class Row:
    label: str
    cells: list
    source: Json | Lines | ServeLog | None = None  # default: the table's


@dataclass(frozen=True)
class Table:
    header: list[str]
    rows: list[Row]
    source: Json | Lines | ServeLog | None = None


@dataclass(frozen=True)
class Section:
    anchor: str
    title: str
    text: str
    tables: list[Table] = field(default_factory=list)


# ---- the rows shown ----

SLICE_V4 = Json("2026-12-01-NVIDIA-H200-e1ceeea.json")
SLICE_V41 = Json("2026-12-01-NVIDIA-H200-3e974b7.json")
SLICE_FP8 = Json("2026-12-02-NVIDIA-H200-4be8e2d-fp8-targets.json")
SLICE_FP4 = Json("2026-12-01-NVIDIA-H200-14a04f6.json")


def row(engine: str, phase: str, batch: int, seq: int | None = None, context: int | None = None) -> str:
    """Path of one Flash-slice row."""
    conds = [f"engine={engine}", f"phase={phase}", f"batch={batch}"]
    conds += [f"seq={seq}"] if seq is not None else []
    conds += [f"context={context}"] if context is not None else []
    return f"rows[{','.join(conds)}]"


def replay(engine: str, phase: str, batch: int, seq: int | None, context: int | None):
    """The decode row's graph replay alone (`decode-graph-replay`); prefill rows have none."""
    return ms(row(engine, "decode-graph-replay", batch, seq, context)) if phase == "decode" else T("")


def ms(path: str, none: str | None = None) -> V:
    return V(path + ".step_ms", "{:.2f} ms", none=none)


def ktoks(path: str) -> V:
    return V(path + ".tokens_per_s", "{:.1f} k tok/s", 1e-3)


def roof(path: str) -> V:
    return V(path + ".roofline_ms", "{:.2f} ms")


V4_SLICE_ROWS = [("prefill 4 x 2048", "prefill", 4, 2048, None), ("prefill 1 x 8192", "prefill", 1, 8192, None),
                 ("prefill 1 x 2048", "prefill", 1, 2048, None), ("decode batch 1, ctx 256", "decode", 1, None, 256),
                 ("decode batch 64, ctx 256", "decode", 64, None, 256),
                 ("decode batch 128, ctx 256", "decode", 128, None, 256),
                 ("decode batch 64, ctx 4096", "decode", 64, None, 4096),
                 ("decode batch 128, ctx 4096", "decode", 128, None, 4096)]


def v4_slice_row(label, phase, batch, seq, context) -> Row:
    di, tf = row("deepinfer", phase, batch, seq, context), row("transformers", phase, batch, seq, context)
    return Row(label, [ms(di), ktoks(di), replay("deepinfer", phase, batch, seq, context), ms(tf, none="not run"),
                       roof(di),
                       Ratio(V(tf + ".step_ms"), V(di + ".step_ms")),
                       Ratio(V(di + ".step_ms"), V(di + ".roofline_ms"))])


def invariant_row(label, phase, batch, seq, context) -> Row:
    on, off = row("deepinfer-invariant", phase, batch, seq, context), row("deepinfer", phase, batch, seq, context)
    return Row(label, [ms(on), ms(off), Ratio(V(on + ".tokens_per_s"), V(off + ".tokens_per_s"), "{:.1%}", loss=True)])


def v41_row(label, phase, batch, seq, context) -> Row:
    bf, fp = row("deepinfer-v41", phase, batch, seq, context), row("deepinfer-v41-fp8", phase, batch, seq, context)
    return Row(label, [ms(bf), replay("deepinfer-v41", phase, batch, seq, context), ms(fp),
                       replay("deepinfer-v41-fp8", phase, batch, seq, context), roof(bf), roof(fp),
                       Ratio(V(bf + ".step_ms"), V(bf + ".roofline_ms"))])


V41_ROWS = [("prefill 4 x 2048", "prefill", 4, 2048, None), ("prefill 1 x 8192", "prefill", 1, 8192, None),
            ("decode batch 1, ctx 256", "decode", 1, None, 256), ("decode batch 1, ctx 4096", "decode", 1, None, 4096),
            ("decode batch 16, ctx 256", "decode", 16, None, 256),
            ("decode batch 64, ctx 256", "decode", 64, None, 256),
            ("decode batch 64, ctx 4096", "decode", 64, None, 4096),
            ("decode batch 128, ctx 4096", "decode", 128, None, 4096)]


def fp8_row(label, phase, batch, seq, context) -> Row:
    fp, bf = row("deepinfer-fp8", phase, batch, seq, context), row("deepinfer", phase, batch, seq, context)
    held = (V(fp + ".roofline_held_ms", "{:.2f} ms"), Ratio(V(fp + ".step_ms"), V(fp + ".roofline_held_ms"))) \
        if phase == "decode" else (T(""), T(""))
    return Row(label, [ms(fp), replay("deepinfer-fp8", phase, batch, seq, context), ms(bf),
                       Ratio(V(fp + ".step_ms"), V(bf + ".step_ms")), roof(fp),
                       Ratio(V(fp + ".step_ms"), V(fp + ".roofline_ms")), *held])


FP8_ROWS = [("prefill 4 x 2048", "prefill", 4, 2048, None), ("decode batch 1, ctx 256", "decode", 1, None, 256),
            ("decode batch 64, ctx 256", "decode", 64, None, 256),
            ("decode batch 256, ctx 256", "decode", 256, None, 256)]


def fp4_row(label, phase, batch, seq, context=None) -> Row:
    p4, p8 = row("deepinfer-fp4", phase, batch, seq, context), row("deepinfer-fp8", phase, batch, seq, context)
    return Row(label, [ms(p4), ms(p8), Ratio(V(p4 + ".step_ms"), V(p8 + ".step_ms"))])


def overhead_row(label: str, source: Json, arch: str, key: str, counts=(1, 16, 64, 256)) -> Row:
    return Row(label, [V(f"rows[arch={arch},phase=decode,requests={n}].{key}", "{:.2f} ms") for n in counts], source)


def serve_row(label: str, model: str, conc: int) -> Row:
    return Row(label, [T(str(conc)), V("output_throughput", "{:,.0f}"), V("median_ttft_ms", "{:.0f}"),
                       V("median_tpot_ms", "{:.2f}"), V("p99_e2el_ms", "{:,.0f}"), V("completed"), V("failed")],
               Json(f"2026-12-01-h200-bench-serve-{model}-c{conc}-c87b752.json", device="H200 (the run's log)"))


SERVE_LOG = ServeLog("2026-12-01-h200-bench-serve-c87b752.log", device="H200 (the log's header)")


def serve_log_row(label: str, model: str, conc: int) -> Row:
    r = f"rows[model={model},max_concurrency={conc}]"
    return Row(label, [T(str(conc)), V(r + ".Output token throughput (tok/s)", "{:,.0f}"),
                       V(r + ".Median TTFT (ms)", "{:.0f}"), V(r + ".Median TPOT (ms)", "{:.2f}"),
                       V(r + ".P99 E2EL (ms)", "{:,.0f}"), V(r + ".Successful requests"),
                       V(r + ".Failed requests", none="0")], SERVE_LOG)


def spec_row(label: str, method: str, conc: int, rate: float | None = None, varlen: bool | None = None) -> Row:
    r = f"rows[method={method},concurrency={conc}" + ("" if rate is None else f",acceptance_rate={rate}") + \
        ("" if varlen is None else f",varlen={str(varlen).lower()}") + "]"
    off = f"rows[method=off,concurrency={conc}]"
    acc = T("") if method == "off" else V(r + ".mean_acceptance_length", "{:.2f}", none="no drafts")
    return Row(label, [T(str(conc)), V(r + ".output_tokens_per_s", "{:,.1f}"), acc,
                       Ratio(V(r + ".output_tokens_per_s"), V(off + ".output_tokens_per_s")), V(r + ".equal_to_off")])


SPEC_HEADER = ["method", "concurrency", "emitted tok/s", "mean acceptance length", "vs off", "tokens equal to off"]


def rows_sum(m: int, impl: str) -> Sum:
    return Sum(f"rows[M={m},impl={impl}].ms", "{:.0f} us", 1e3)


EVAL = "runs"
CPU_CI = "CPU (2 cores, the project's CI host)"
BF16_DEMO_CPU = Json("2026-12-07-cpu-bf16-vs-reference-demo41-a8ffb82.json", device=CPU_CI)
BF16_DEMO_GPU = Json("2026-12-07-h100-bf16-vs-reference-demo41-3f6619c.json")

SECTIONS = [
    Section("v4-flash-slice", "V4 Flash slice: engine step, transformers and the roofline",
            "V4-Flash's first four layers at full width (sliding, sliding, CSA, HCA; 256 experts; random weights), "
            "bf16, through the engine's own step (`EngineCore.step`; a decode row is the steady asynchronous step "
            "with its CUDA graph, and *replay alone* is `DecodeGraphs.run` by itself), against transformers' "
            "`DeepseekV4ForCausalLM` on the same weights and the roofline (bytes / measured copy bandwidth, FLOPs / "
            "measured bf16 matmul rate) of the same run. Command: `ENGINES=deepinfer,deepinfer-fp8,transformers,"
            "deepinfer-invariant COMMIT=<hash> REPS=3 bash benchmarks/run_sweep.sh`. transformers is skipped where "
            "its cache would need a prefill of the whole batch x context.",
            [Table(["workload", "deepinfer step", "deepinfer tokens/s", "replay alone", "transformers step",
                    "roofline", "transformers / deepinfer time", "deepinfer / roofline time"],
                   [v4_slice_row(*r) for r in V4_SLICE_ROWS], SLICE_V4)]),
    Section("fp8-flash-slice", "V4 Flash slice: FP8/FP4 weights as shipped against bf16",
            "The same slice with the checkpoint's FP8 block weights and FP4 routed experts kept as shipped (the "
            "experts held as FP8 codes on Hopper), both engines in one run. *Roofline* counts the experts as "
            "shipped (FP4 codes); *held roofline* counts them as the engine holds them (FP8 codes). Command: "
            "`python benchmarks/flash_slice.py --engines deepinfer,deepinfer-fp8 --reps 2 --prefill 4x2048 "
            "--decode-batches 1,64,256 --decode-contexts 256`.",
            [Table(["workload", "FP8/FP4 step", "FP8/FP4 replay alone", "bf16 step", "FP8 / bf16 time", "roofline",
                    "FP8 / roofline", "held roofline", "FP8 / held roofline"],
                   [fp8_row(*r) for r in FP8_ROWS], SLICE_FP8)]),
    Section("packed-fp4-experts", "Packed FP4 experts against FP8 codes",
            "Routed experts left packed as FP4 (decoded in registers by the grouped GEMM: engine `deepinfer-fp4`) "
            "against the same experts rewritten as FP8 codes at start-up (`deepinfer-fp8`, what `LLM` does where "
            "the copy fits), V4 slice, one run.",
            [Table(["workload", "packed FP4", "FP8 codes", "FP4 / FP8 time"],
                   [fp4_row("prefill 4 x 2048", "prefill", 4, 2048),
                    fp4_row("decode batch 1, ctx 256", "decode", 1, None, 256),
                    fp4_row("decode batch 64, ctx 256", "decode", 64, None, 256)], SLICE_FP4)]),
    Section("v41-flash-slice", "V4.1 Flash slice",
            "V4.1-Flash at full width (hidden 5120, 64 heads x 512, 384 experts top-6), 8 layers with one of every "
            "layer role, cache in the reference formats (`auto`), prefill with bounded replay (keep 140). Scaled "
            "down, as the results' `slices` entry says: a smaller Engram table, a synthetic token map, and one set "
            "of routed experts shared by the 8 layers (the roofline still counts 8). Command: "
            "`ENGINES=deepinfer,deepinfer-v41,deepinfer-v41-fp8 COMMIT=<hash> REPS=2 bash benchmarks/run_sweep.sh`.",
            [Table(["workload", "bf16 step", "bf16 replay alone", "FP8/FP4 step", "FP8/FP4 replay alone",
                    "roofline bf16", "roofline FP8/FP4", "bf16 / roofline time"],
                   [v41_row(*r) for r in V41_ROWS], SLICE_V41)]),
    Section("executor-overhead", "The multi-process executor at one rank",
            "Every parallel layout runs through the multi-process executor (the driver's step messages to its "
            "ranks, the workers' launch / collect): at one rank (`distributed_executor_backend=\"mp\"`) it runs "
            "that path with nobody to send to, beside the in-process engine on the same slice, both with CUDA graphs "
            "and async scheduling, decode at context 256, dummy FP8/FP4 weights. Command: `cd benchmarks && "
            "python executor_overhead.py --slices v4,v41 --batches 1,64` (the executor rows of `run_sweep.sh`).",
            [Table(["workload", "in-process", "multi-process, one rank", "multi-process / in-process tokens/s"],
                   [Row(f"{name} decode batch {b}",
                        [V(f"rows[slice={arch},executor=uni,batch={b}].tokens_per_s", "{:.1f} tok/s"),
                         V(f"rows[slice={arch},executor=mp,batch={b}].tokens_per_s", "{:.1f} tok/s"),
                         Ratio(V(f"rows[slice={arch},executor=mp,batch={b}].tokens_per_s"),
                               V(f"rows[slice={arch},executor=uni,batch={b}].tokens_per_s"), "{:.1%}")])
                    for name, arch in (("V4 slice", "v4"), ("V4.1 slice", "v41")) for b in (1, 64)],
                   Json("2026-12-07-h100-executor-overhead-fff8e94.json"))]),
    Section("batch-invariance-cost", "Cost of batch-invariant mode",
            "Tokens/s lost with `batch_invariant=True`. GPU: engine `deepinfer-invariant` of the V4 sweep above, "
            "same run as its bf16 rows. CPU: `python benchmarks/offline_throughput.py --preset demo --device cpu "
            "--batch-invariant-cost --skip-transformers` (demo model, fp32, 16 x (64 in, 32 out)).",
            [Table(["workload", "switch on", "switch off", "tokens/s lost"],
                   [invariant_row(*r) for r in [("decode batch 1, ctx 256", "decode", 1, None, 256),
                                                ("decode batch 16, ctx 256", "decode", 16, None, 256),
                                                ("decode batch 64, ctx 256", "decode", 64, None, 256),
                                                ("decode batch 128, ctx 256", "decode", 128, None, 256),
                                                ("decode batch 64, ctx 4096", "decode", 64, None, 4096),
                                                ("prefill 4 x 2048", "prefill", 4, 2048, None)]], SLICE_V4),
             Table(["workload", "switch on", "switch off", "tokens/s lost"],
                   [Row("CPU, demo, 16 x (64 in, 32 out)",
                        [V("rows[engine=deepinfer (batch_invariant)].output_tokens_per_s", "{:.1f} tok/s"),
                         V("rows[engine=deepinfer].output_tokens_per_s", "{:.1f} tok/s"),
                         Ratio(V("rows[engine=deepinfer (batch_invariant)].output_tokens_per_s"),
                               V("rows[engine=deepinfer].output_tokens_per_s"), "{:.1%}", loss=True)])],
                   Json("2026-11-29-cpu-batch-invariant-cost.json", device=CPU_CI))]),
    Section("mma-rows", "A GEMM row's bits across tile shapes",
            "`python benchmarks/mma_rows_probe.py`: the batch-invariant GEMM (`kernels/invariant_matmul.py`) at "
            "other tile shapes and warp counts, K loop unchanged, each output row compared bit for bit with the "
            "default tiling's: the ground for giving the invariant GEMMs shape-tuned tiles (not done yet).",
            [Table(["kernel", "variants tried", "rows bit-identical in"],
                   [Row(label, [Count(f"rows[{sel}].identical"), Count(f"rows[{sel},identical=true].identical")])
                    for label, sel in [("invariant GEMM, bf16", 'kernel=invariant_matmul,dtype="torch.bfloat16"'),
                                       ("invariant GEMM, fp32", 'kernel=invariant_matmul,dtype="torch.float32"'),
                                       ("grouped expert GEMM, bf16 weights", "kernel=grouped_gemm,fmt=bf16"),
                                       ("grouped expert GEMM, FP8 weights", "kernel=grouped_gemm,fmt=fp8")]],
                   Json("2026-11-29-h200-mma-rows-probe.json"))]),
    Section("identical-completions", "1000 identical requests",
            "Thinking Machines' check, `python benchmarks/identical_completions.py`: one 48-token prompt completed "
            "greedily (32 tokens) 1000 times amid random neighbours on engines with different token budgets; "
            "distinct completions counted by tokens and logprob bits.",
            [Table(["run", "batch invariant", "completions", "distinct"],
                   [Row("CPU, V4 demo, fp32", [T("off"), V("rows[batch_invariant=false].completions"),
                                                V("rows[batch_invariant=false].unique")],
                        Json("2026-11-29-cpu-identical-completions.json", device=CPU_CI)),
                    Row("CPU, V4 demo, fp32", [T("on"), V("rows[batch_invariant=true].completions"),
                                                V("rows[batch_invariant=true].unique")],
                        Json("2026-11-29-cpu-identical-completions.json", device=CPU_CI)),
                    Row("GPU, V4 demo, bf16, graphs + async", [T("on"), V("rows[0].completions"), V("rows[0].unique")],
                        Json("2026-12-01-h200-identical-completions-1000-e1ceeea.json")),
                    Row("GPU, V4.1 demo, bf16, graphs + async", [T("on"), V("rows[0].completions"),
                                                                 V("rows[0].unique")],
                        Json("2026-12-01-h200-identical-completions-demo41-c7f7457.json"))])]),
    Section("async-scheduling", "Asynchronous scheduling",
            "`python benchmarks/async_overlap.py`: V4 demo model, bf16, 32 prompts x (128 in, 64 out), async "
            "scheduling off and on.",
            [Table(["mode", "output tok/s", "step", "GPU busy per step", "GPU idle per step (profiled)"],
                   [Row(label, [V(f"rows[async_scheduling={flag}].tokens_per_s", "{:.0f}"),
                                V(f"rows[async_scheduling={flag}].step_ms", "{:.2f} ms"),
                                V(f"rows[async_scheduling={flag}].gpu_busy_ms_per_step", "{:.2f} ms"),
                                V(f"rows[async_scheduling={flag}].gpu_idle_ms_per_step", "{:.2f} ms")])
                    for label, flag in [("synchronous", "false"), ("async (default)", "true")]],
                   Json("2026-11-29-h200-async-overlap.json"))]),
    Section("engine-host-overhead", "Host time per engine step",
            "`python benchmarks/engine_overhead.py`: `EngineCore.step` in pure decode with the model's forward "
            "replaced by a no-op (`noop`: host work alone) or the demo model (`real`), ms per step at 1 / 16 / 64 / "
            "256 requests. CPU rows are process CPU time on the shared 2-core CI host, which is noisy (the same "
            "configuration varies up to 2x between runs); df8483c is the array-planned decode path.",
            [Table(["run", "1", "16", "64", "256"],
                   [overhead_row("CPU, V4 noop, 0a6a1e9", Json("2026-12-01-cpu-engine-overhead-0a6a1e9.json", CPU_CI),
                                 "v4", "process_cpu_ms_per_step"),
                    overhead_row("CPU, V4 noop, fd532e6", Json("2026-12-01-cpu-engine-overhead-fd532e6.json", CPU_CI),
                                 "v4", "process_cpu_ms_per_step"),
                    overhead_row("CPU, V4.1 noop, 0a6a1e9",
                                 Json("2026-12-01-cpu-engine-overhead-0a6a1e9.json", CPU_CI), "v41",
                                 "process_cpu_ms_per_step"),
                    overhead_row("CPU, V4.1 noop, fd532e6",
                                 Json("2026-12-01-cpu-engine-overhead-fd532e6.json", CPU_CI), "v41",
                                 "process_cpu_ms_per_step"),
                    overhead_row("CPU, V4 noop, df8483c", Json("2026-12-01-cpu-engine-overhead-df8483c.json", CPU_CI),
                                 "v4", "process_cpu_ms_per_step"),
                    overhead_row("CPU, V4.1 noop, df8483c",
                                 Json("2026-12-01-cpu-engine-overhead-df8483c.json", CPU_CI), "v41",
                                 "process_cpu_ms_per_step"),
                    overhead_row("GPU host, V4 noop", Json("2026-12-01-h200-engine-overhead-noop-b338070.json"),
                                 "v4", "host_ms_per_step"),
                    overhead_row("GPU host, V4.1 noop", Json("2026-12-01-h200-engine-overhead-noop-b338070.json"),
                                 "v41", "host_ms_per_step")]),
             Table(["run", "1", "64", "256"],
                   [overhead_row(f"GPU, {arch} real, {commit}",
                                 Json(f"2026-12-01-h200-engine-overhead-real-{commit}.json"), key, "ms_per_step",
                                 (1, 64, 256))
                    for arch, key in [("V4", "v4"), ("V4.1", "v41")] for commit in ["666970d", "b338070"]])]),
    Section("demo-throughput", "End to end on the demo models",
            "`python benchmarks/demo_throughput.py`: `LLM.generate` with its defaults (bf16, kv `auto`, async "
            "scheduling, decode graphs), greedy, `ignore_eos`, median of the reps; the random-weight demo models "
            "(V4: 8 layers, V4.1: 10 layers, hidden 256). These small models are bound by the host.",
            [Table(["model", "workload", "output tok/s", "async", "graphs"],
                   [Row(f"{label}, {commit}", [T(work), V(f"rows[model={model}].output_tokens_per_s", "{:,.0f}"),
                                               V(f"rows[model={model}].async_scheduling"),
                                               V(f"rows[model={model}].cuda_graphs")],
                        Json(f"2026-12-01-h200-demo-throughput-{file}.json"))
                    for file, commit, work in [("32a4bc3", "32a4bc3", "64 x (256 in, 128 out)"),
                                               ("3e974b7", "3e974b7", "64 x (256 in, 128 out)"),
                                               ("64x32x256-666970d", "666970d", "64 x (32 in, 256 out)"),
                                               ("64x32x256-b338070", "b338070", "64 x (32 in, 256 out)")]
                    for label, model in [("V4 demo", "V4 demo"), ("V4.1 demo", "V4.1 demo")]]
                   + [Row(f"V4.1 demo, engram_device=cpu, {c}", [T("64 x (256 in, 128 out)"),
                          V('rows[model="V4.1 demo, engram_device=cpu"].output_tokens_per_s', "{:,.0f}"),
                          V('rows[model="V4.1 demo, engram_device=cpu"].async_scheduling'),
                          V('rows[model="V4.1 demo, engram_device=cpu"].cuda_graphs')],
                          Json(f"2026-12-01-h200-demo-throughput-{c}.json")) for c in ["32a4bc3", "3e974b7"]]),
             Table(["where", "workload", "deepinfer", "transformers", "deepinfer / transformers"],
                   [Row("CPU, demo model, fp32, kv auto", [T("16 x (64 in, 32 out)"),
                        V("rows[engine=deepinfer].output_tokens_per_s", "{:.1f} tok/s"),
                        V("rows[engine=transformers].output_tokens_per_s", "{:.1f} tok/s"),
                        Ratio(V("rows[engine=deepinfer].output_tokens_per_s"),
                              V("rows[engine=transformers].output_tokens_per_s"))],
                        Json("2026-11-29-cpu-offline.json", device=CPU_CI))])]),
    Section("serving", "Serving: `deepinfer bench serve`",
            "`deepinfer serve` with default flags on the random-weight demo models (V4.1: `--model demo-random`, "
            "bf16; V4: the writer's `demo` preset, served in its shipped FP8 formats), 1024 tokens in, 128 out, "
            "greedy, `--ignore-eos`; `COMMIT=<hash> bash benchmarks/serve_bench.sh OUT`. The V4.1 row at 64 is read "
            "from the run's log (its JSON did not come back from the device).",
            [Table(["model", "concurrency", "output tok/s", "median TTFT ms", "median TPOT ms", "P99 E2EL ms",
                    "completed", "failed"],
                   [serve_row("V4.1 demo", "v41", 1), serve_row("V4.1 demo", "v41", 16),
                    serve_log_row("V4.1 demo", "v41", 64), serve_row("V4 demo (FP8)", "v4", 1),
                    serve_row("V4 demo (FP8)", "v4", 16), serve_row("V4 demo (FP8)", "v4", 64)])]),
    Section("speculative-decoding", "Speculative decoding",
            "`python benchmarks/spec_decode.py`: the V4.1 demo (bf16), k = 5, greedy, 128 prompt tokens; emitted "
            "tokens/s against speculation off in the same run. `oracle r` drafts tokens that are right with "
            "probability r. The first table is the latest: verify and draft steps on CUDA graphs (195f977; an "
            "H100, 256 tokens out; `--varlen`: one verify length a step over step times measured at start-up, "
            "which here turned speculation off): fixed-length speculation is still slower than off, and why a "
            "graphed verify step costs what it does is not yet profiled on a GPU (benchmarks/NOTES.md). The two "
            "older tables ran with eager speculative steps (924d9f0, 128 out); the third with "
            "`batch_invariant=True`: without it, verify chunks round differently from one-token decode, near-tied "
            "logits diverge from speculation off and the oracle's drafts stop matching at higher concurrency.",
            [Table(SPEC_HEADER, [spec_row("off", "off", 1), spec_row("oracle 0.8, fixed k", "oracle", 1, 0.8, False),
                                 spec_row("oracle 0.8, varlen", "oracle", 1, 0.8, True)],
                   Json("2026-12-07-h100-195f977-spec-decode-oracle-c1.json")),
             Table(SPEC_HEADER, [spec_row(*r) for r in [("off", "off", 1), ("DSpark (random stages)", "dspark", 1),
                                                        ("oracle 0.8", "oracle", 1, 0.8),
                                                        ("oracle 0.95", "oracle", 1, 0.95),
                                                        ("prompt lookup", "ngram", 1)]],
                   Json("2026-12-01-NVIDIA-H200-924d9f0-spec-decode-speed.json")),
             Table(SPEC_HEADER, [spec_row(*r) for c in (1, 16, 64)
                                 for r in [("off", "off", c), ("oracle 0.8", "oracle", c, 0.8)]],
                   Json("2026-12-01-NVIDIA-H200-924d9f0-spec-decode-invariant.json"))]),
    Section("structured-outputs", "Structured outputs",
            "`python benchmarks/structured_outputs.py`: the demo model, 128 tokens a request, unconstrained against "
            "a JSON schema at the same batch.",
            [Table(["batch", "free tok/s", "JSON schema tok/s", "cost per output token"],
                   [Row(str(b), [V(f"rows[mode=free,batch={b}].tokens_per_s", "{:,.0f}"),
                                 V(f"rows[mode=json,batch={b}].tokens_per_s", "{:,.0f}"),
                                 V(f"rows[mode=json,batch={b}].overhead_vs_free", "{:+.1%}")]) for b in (1, 16, 64)],
                   Json("2026-12-01-NVIDIA-H200-80721a5-structured-outputs.json"))]),
    Section("fp8-linears", "FP8 linears: W8A8 against W8A16 by row count",
            "`python benchmarks/kernel_sweep.py --only fp8-rows`: time summed over V4's eight projection shapes "
            "at each row count; cuBLAS bf16 reads twice the weight bytes. The later run adds the swapped W8A16 "
            "tile (rows in the MMA's N) that is now the default at 2-63 rows.",
            [Table(["rows", "W8A8", "W8A16", "cuBLAS bf16"],
                   [Row(str(m), [rows_sum(m, "w8a8"), rows_sum(m, "w8a16"), rows_sum(m, "cublas-bf16")])
                    for m in (1, 32, 64, 128, 256)], Json("2026-12-02-h200-kernel-sweep-fp8-rows-bd3db3a.json")),
             Table(["rows", "swapped W8A16 (bm 16/32, bn 64, 4 warps, 3 stages)", "W8A16", "cuBLAS bf16"],
                   [Row(str(m), [rows_sum(m, f"w8a16-swap-bm{bm}-bn64-w4-s3-sk8"), rows_sum(m, "w8a16"),
                                 rows_sum(m, "cublas-bf16")]) for m, bm in ((4, 16), (16, 16), (32, 32))],
                   Json("2026-12-02-h200-kernel-sweep-fp8-rows-202670b.json"))]),
    Section("fp8-experts", "FP8 routed experts: one V4 expert layer",
            "`python benchmarks/fp8_gemm_bench.py --experts`: the three projections of one V4 MoE layer (256 "
            "experts, top-6) at a given token count.",
            [Table(["tokens", "bf16 `torch._grouped_mm`", "W8A16", "W8A8 (Triton)", "W8A8 (Triton, TMA)",
                    "W8A8 (Gluon)"],
                   [Row(str(t), [V(f"summary[tokens={t}].layer_us.{p}", "{:,.0f} us")
                                 for p in ("bf16", "w8a16", "w8a8", "w8a8-gemm-tma", "w8a8-gemm-gluon")])
                    for t in (512, 4096, 8192)], Json("2026-12-02-h200-fp8-experts-gluon-fb1f3e4.json")),
             Table(["tokens", "bf16", "W8A16", "W8A16 (folded scales)", "W8A8"],
                   [Row(str(t), [V(f"summary[tokens={t}].layer_us.{p}", "{:,.0f} us")
                                 for p in ("bf16", "w8a16", "w8a16-folded", "w8a8")]) for t in (1, 16, 64)],
                   Json("2026-12-01-h200-fp8-experts-80721a5.json"))]),
    Section("weights-memory", "Weights as shipped in GPU memory",
            "`python benchmarks/weights_memory.py`: V4-Flash and V4.1-Flash widths with 2 layers and 8 routed "
            "experts each; `torch.cuda.memory_allocated` across loading against the shards' tensor bytes and the "
            "same model in bf16.",
            [Table(["model", "`quantization`", "allocated / on disk", "allocated / bf16"],
                   [Row(f"{label}", [T(q), V(f"rows[arch={arch},quantization={qv}].ratio_to_disk", "{:.3f}x"),
                                     V(f"rows[arch={arch},quantization={qv}].ratio_to_bf16", "{:.3f}x")])
                    for label, arch in [("V4", "v4"), ("V4.1", "v41")]
                    for q, qv in [("default (as shipped)", "null"), ('"none"', "none")]],
                   Json("2026-12-01-h200-weights-memory-b338070.json"))]),
    Section("demo-evaluation", "The trained demo model's evaluation",
            "The `eval` tools on the trained demo (`deepinfer/assets/demo41`), held-out standard-library files, "
            "fp32 on the CPU; the commands are in the file.",
            [Table(["measure", "value"],
                   [Row("perplexity (engine)", [V(f"{EVAL}.perplexity.result.perplexity", "{:.2f}")]),
                    Row("perplexity (NeMo reference)", [V(f"{EVAL}.perplexity.result.reference_perplexity", "{:.2f}")]),
                    Row("greedy agreement with NeMo", [V(f"{EVAL}.agreement.result.greedy_agreement", "{:.2f}")]),
                    Row("DSpark mean acceptance length (k = 5)",
                        [V(f"{EVAL}.dspark.result.mean_acceptance_length", "{:.2f}")]),
                    Row("bounded replay keep 40: mean KL to exact prefill",
                        [V(f"{EVAL}.replay.result.per_keep[keep=40].kl_mean", "{:.1e}")]),
                    Row("bounded replay keep 40: greedy agreement",
                        [V(f"{EVAL}.replay.result.per_keep[keep=40].greedy_agreement", "{:.2f}")]),
                    Row("bounded replay keep 140: mean KL to exact prefill",
                        [V(f"{EVAL}.replay.result.per_keep[keep=140].kl_mean", "{:.1e}")]),
                    Row("structured outputs: valid / completions",
                        [Pair(V(f"{EVAL}.structured.result.valid"), V(f"{EVAL}.structured.result.completions"))]),
                    ], Json("2026-12-02-cpu-eval-demo-13e786a.json"))]),
    Section("bf16-vs-reference", "bf16 against the fp32 references",
            "`python benchmarks/bf16_vs_reference.py`: the tiny random checkpoints on the CPU's torch reference path, "
            "teacher-forced against the fp32 reference (transformers for V4, NeMo AutoModel for V4.1): the largest "
            "|logprob difference| over the top 5, and how often the reference's argmax is deepinfer's token. bf16 "
            "alone moves these random models by nats (their logits are near ties everywhere). The second table is "
            "the trained demo (`--cases demo41`: text prompts, 4 x 10 greedy tokens), where bf16 moves logprobs by "
            "tenths of a nat and keeps every argmax. The largest difference is one tail entry of the top 5, and "
            "how far it moves depends on summation order: the CPU bf16 reference of the GPU machine's host gives "
            "the GPU's largest difference, not the CI host's (`benchmarks/results/2026-12-07-h100-bf16-gap-"
            "variants-3f6619c.txt`), so the GPU test compares with the CPU bf16 reference of its own host.",
            [Table(["model", "dtype", "kv cache", "max top-5 logprob difference", "argmax agreement"],
                   [Row(label, [T(dt), T(kv), V(f"rows[model={m},dtype={dt},kv={kv}].diff", "{:.2f}"),
                                Pair(V(f"rows[model={m},dtype={dt},kv={kv}].agree"),
                                     V(f"rows[model={m},dtype={dt},kv={kv}].of"))])
                    for label, m, dt, kv in [("V4", "v4", "float32", "float32"), ("V4", "v4", "bfloat16", "bfloat16"),
                                             ("V4.1", "v41", "float32", "float32"),
                                             ("V4.1", "v41", "bfloat16", "bfloat16"),
                                             ("V4.1", "v41", "bfloat16", "auto")]],
                   Lines("2026-12-01-cpu-bf16-vs-reference.txt",
                         r"^(?P<model>v41?) cpu dtype (?P<dtype>\w+) kv (?P<kv>\w+): max \|logprob - reference fp32\| "
                         r"over the top-5 (?P<diff>[\d.]+); reference argmax = deepinfer's token at (?P<agree>\d+) / "
                         r"(?P<of>\d+) positions$", r"^# commit ([0-9a-f]{7,40})", CPU_CI)),
             Table(["trained demo (V4.1)", "dtype", "kv cache", "max top-5 logprob difference", "argmax agreement"],
                   [Row(label, [T(dt), T(kv), V(f"rows[dtype={dt},kv_cache_dtype={kv}].max_abs_logprob_gap", "{:.3f}"),
                                Pair(V(f"rows[dtype={dt},kv_cache_dtype={kv}].argmax_agree"),
                                     V(f"rows[dtype={dt},kv_cache_dtype={kv}].positions"))], src)
                    for label, src in [("CPU (CI host)", BF16_DEMO_CPU), ("H100, CUDA graphs + async", BF16_DEMO_GPU)]
                    for dt, kv in [("float32", "float32"), ("float32", "auto"), ("bfloat16", "bfloat16"),
                                   ("bfloat16", "auto")]])]),
    Section("parallel-parity", "Parallel layouts against one process",
            "`python benchmarks/parallel_parity.py`: the tiny V4 model on CPU gloo ranks, fp32; largest |logprob "
            "difference| from one process, and whether the greedy tokens are equal.",
            [Table(["layout", "greedy tokens equal", "max logprob difference"],
                   [Row(label, [V(f'rows[setup="{setup}"].equal'), V(f'rows[setup="{setup}"].diff', "{:.1e}")])
                    for label, setup in [("TP = 2", "tp=2"), ("TP = 4", "tp=4"), ("DP = 2 + EP", "dp=2 + ep"),
                                         ("DP = 4 + EP + EPLB every 2 steps", "dp=4 + ep + eplb every 2 steps"),
                                         ("CP = 2", "cp=2")]],
                   Lines("2026-12-01-cpu-parallel-parity.txt",
                         r"^(?P<setup>[a-z]+=\d[^\n]*?)\s{2,}greedy tokens equal: (?P<equal>\w+)\s+"
                         r"max \|logprob difference\|: (?P<diff>\S+)$", r"^# commit ([0-9a-f]{7,40})", CPU_CI))]),
    Section("eplb-balance", "EPLB placement",
            "`python benchmarks/eplb_balance.py`: busiest GPU's load with EPLB over naive contiguous placement "
            "(mean over 8 layers), expert loads drawn from Zipf(s), and the same on an independent second sample "
            "(*next window*).",
            [Table(["setup", "policy", "s", "ratio", "next window ratio"],
                   [Row(setup, [V(f"{r}.policy"), V(f"{r}.s"), V(f"{r}.ratio", "{:.2f}"), V(f"{r}.next", "{:.2f}")])
                    for setup in ["V4-Flash decode EP8", "V4-Flash prefill EP16, 2 nodes", "V4-Flash decode EP64"]
                    for s in ("0.6", "1.2") for r in [f'rows[setup="{setup}",s={s}]']],
                   Lines("2026-12-01-cpu-eplb-balance.txt",
                         r"^(?P<setup>V4[^\n]*?)\s{2,}(?P<policy>global|hierarchical)\s+(?P<s>[\d.]+)\s+"
                         r"(?P<naive>[\d.]+)\s+(?P<eplb>[\d.]+)\s+(?P<ratio>[\d.]+)\s+(?P<worst>[\d.]+)\s+"
                         r"(?P<next_eplb>[\d.]+)\s+(?P<next>[\d.]+)$", r"commit ([0-9a-f]{7,40})", CPU_CI))]),
]


# ---- rendering ----

def source_caption(src, doc: dict) -> str:
    commit = doc.get("commit")
    what = f"commit `{commit}`" if commit else f"no commit recorded (its note: {doc.get('commit_note', 'none')})"
    device = src.device or doc.get("device_name") or doc.get("device") or doc.get("machine")
    if not device:
        raise ValueError(f"{src.file}: names no device and the spec gives none")
    return f"[`{src.file}`](../benchmarks/results/{src.file}): {what}, {device}"


def render_table(table: Table, cache: dict) -> list[str]:
    lines = ["| " + " | ".join(table.header) + " |", "|" + "---|" * len(table.header)]
    sources = []
    for r in table.rows:
        src = r.source or table.source
        if src.file not in cache:
            cache[src.file] = src.load()
        doc = cache[src.file]
        if src not in sources:
            sources.append(src)
        cells = [r.label] + [c.render(doc) for c in r.cells]
        if len(cells) != len(table.header):
            raise ValueError(f"{r.label}: {len(cells)} cells for {len(table.header)} columns")
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    captions = [source_caption(s, cache[s.file]) for s in sources]
    return lines + ["", "Source: " + "; ".join(captions) + ".", ""]


def render() -> str:
    out = ["# Benchmarks", "",
           "<!-- Generated by `python benchmarks/make_docs.py` from benchmarks/results/: do not edit by hand. -->", "",
           "Every number on this page is read from the results file named under its table, which records the commit "
           "and the device that measured it; ratios are computed from rows of the same file (one run). Other pages "
           "link here rather than repeat numbers. How each result came about, and older runs: "
           "[benchmarks/NOTES.md](../benchmarks/NOTES.md).", ""]
    out += [f"- [{s.title}](#{s.anchor})" for s in SECTIONS] + [""]
    cache: dict = {}
    for s in SECTIONS:
        out += [f'<a id="{s.anchor}"></a>', "", f"## {s.title}", "", s.text, ""]
        for t in s.tables:
            out += render_table(t, cache)
    return "\n".join(out).rstrip() + "\n"


def quoted_files() -> set[str]:
    """Every results file the page is generated from."""
    files = set()
    for s in SECTIONS:
        for t in s.tables:
            files.update((r.source or t.source).file for r in t.rows)
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with docs/benchmarks.md instead of writing it")
    args = ap.parse_args()
    text = render()
    if args.check:
        if DOC.read_text() != text:
            sys.exit(f"{DOC} is not what `python benchmarks/make_docs.py` generates from the results: regenerate it")
        print(f"{DOC}: up to date")
        return
    DOC.write_text(text)
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
