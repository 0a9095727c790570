"""LLM: the offline API (vLLM's shape): LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import gc
import itertools
import logging
import numbers
import weakref
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from deepinfer.config import EngineConfig, with_option_signature
from deepinfer.engine.detokenizer import Detokenizer
from deepinfer.engine.engine_core import EngineCore
from deepinfer.engine.kv_manager import KVCacheManager, plan_capacity
from deepinfer.engine.memory_fit import (WORKSPACE_BYTES, WeightBytes, check_fit, format_bytes, repack_fits,
                                         requests_at_length)
from deepinfer.engine.outputs import CompletionOutput, RequestOutput
from deepinfer.engine.request import Request, Status
from deepinfer.engine.scheduler import Scheduler, VarlenPolicy
from deepinfer.layers.moe import Experts, repack_fp4_experts
from deepinfer.loader.model_loader import load_model, weight_bytes
from deepinfer.sampling_params import SamplingParams
from deepinfer.tools.demo import resolve_demo
from deepinfer.worker.drafter import DSparkDrafter, MTPDrafter
from deepinfer.worker.kv_cache import allocate_v4_cache, cache_spec, default_cache_memory
from deepinfer.worker.model_runner import ModelRunner
from deepinfer.worker.sps_profile import profile_sps

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
logger = logging.getLogger(__name__)

# a text, token ids, or {"prompt" | "prompt_token_ids": ..., "images": [PIL.Image | bytes, ...]} where each
# image_token_id in the prompt marks where one image goes (it expands to the image's token span)
PromptType = str | list[int] | dict


class LLM:
    @with_option_signature
    def __init__(self, model: str | None = None, **options):
        """`model`: a local dir, a hub id, or "demo" / "demo-random". `options`: the engine options, each a field
        of EngineConfig (deepinfer/config.py: its help, default and DEEPINFER_* variable; docs/offline_api.md
        lists them), the same as the flags of `deepinfer generate` / `deepinfer serve`; an unknown name raises
        TypeError naming the closest option. One not given, or None, comes from its environment variable where it
        has one, else its default. Before any weight is read, the model's bytes (built on the meta device) are
        checked against the GPU's free memory; a model that does not fit raises ValueError with the layouts that
        would."""
        cfg = EngineConfig.from_options(model=model, **options)
        if cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device: {cfg.device!r} needs a CUDA device, and this torch ({torch.__version__}) "
                             "sees none; use device='cpu'")
        _require_one_process(cfg)
        self.config = cfg
        # what close() releases (a multi-process engine, the grammar threads), last acquired first; the
        # finalizer holds this list and never the LLM, so dropping the LLM, or interpreter exit, closes it
        self._owned: list = []
        self._finalizer = weakref.finalize(self, _release, self._owned)
        ref = cfg.model or cfg.hf_model_dir or DEFAULT_MODEL
        ref = resolve_demo(ref) or ref
        self._ids = itertools.count()
        self._grammars = None  # structured outputs: built at the first request with so_args
        if cfg.data_parallel_size > 1:
            self._start_data_parallel(ref)
            return
        if cfg.tensor_parallel_size > 1:
            self._start_tensor_parallel(ref)
            return
        if cfg.context_parallel_size > 1:
            self._start_context_parallel(ref)
            return
        repack: list[bool] = []  # FP4 experts held as FP8 codes: decided before the weights are read
        path, _ = _resolve_checked(cfg, ref, lambda meta: _check_before_load(cfg, meta))
        self.model, self.model_dir = load_model(path, dtype=getattr(torch, cfg.dtype), device=cfg.device,
                                                quantized=cfg.keeps_checkpoint_formats,
                                                hf_model_dir=cfg.hf_model_dir, offline=cfg.hf_hub_offline,
                                                engram_device=cfg.engram_device,
                                                check=lambda meta: repack.append(_check_before_load(cfg, meta)),
                                                load_format=cfg.load_format, seed=cfg.seed or 0)
        if repack and repack[0]:
            repack_fp4_experts(self.model)
        mcfg = self.model.config
        self.detokenizer = None if cfg.skip_tokenizer_init else _load_detokenizer(self.model_dir)
        proposer = _proposer(cfg, mcfg)
        # ring rows for rejected draft positions (k - 1 suffice, tests/state/test_ring_slack.py; k keeps one spare)
        slack = proposer.num_speculative_tokens if proposer else 0
        spec = cache_spec(mcfg, cfg.kv_cache_dtype, cfg.block_size, ring_slack=slack)
        memory = cfg.kv_cache_memory or default_cache_memory(cfg.device)
        expected = cfg.max_model_len or min(mcfg.max_position_embeddings, 4096)
        num_slots, num_blocks = plan_capacity(memory, spec.slot_bytes, spec.block_bytes, cfg.block_size,
                                              cfg.max_num_seqs, expected)
        kv = KVCacheManager(num_slots, num_blocks, cfg.block_size)
        self.max_model_len = kv.max_model_len(cfg.max_model_len, mcfg.max_position_embeddings,
                                               f"{memory} bytes")
        # one slot and one block per ratio beyond the manager's: the padding rows of decode graphs
        cache = allocate_v4_cache(mcfg, num_slots, num_blocks, cfg.kv_cache_dtype, cfg.device, cfg.block_size,
                                  scratch=True, ring_slack=slack)
        self.scheduler = Scheduler(kv, min(cfg.max_num_seqs, num_slots), cfg.max_num_batched_tokens,
                                   self.max_model_len, proposer)
        _log_capacity(self.model, cache, kv, self.max_model_len, cfg)
        drafter = {"dspark": DSparkDrafter, "mtp": MTPDrafter}.get(getattr(proposer, "method", None))
        drafter = drafter and drafter(self.model, cache, slack)
        runner = ModelRunner(self.model, cache, cfg.device, cfg.seed, _replay_keep(cfg, mcfg), not cfg.enforce_eager,
                             cfg.batch_invariant, drafter)
        if cfg.enable_mtp_varlen:
            if drafter is None:
                raise ValueError("enable_mtp_varlen: confidence-scheduled verification needs the model's own draft "
                                 "layers (speculative_config method 'dspark' or 'mtp', or num_speculative_tokens)")
            most = min(cfg.max_num_seqs, num_slots) * (slack + 1)  # every request verifying all its drafts
            self.scheduler.varlen = VarlenPolicy(profile_sps(runner, kv, cfg.max_num_batched_tokens, most),
                                                 _calibration(self.model_dir))
        self.engine = EngineCore(self.scheduler, runner, self.detokenizer, cfg.async_scheduling)
        # the start-up heap (weights' Python objects, tokenizer, configs) is never garbage: moving it out
        # of the collector's generations keeps full collections from pausing steps
        gc.collect()
        gc.freeze()

    def _start_tensor_parallel(self, ref: str) -> None:
        """tensor_parallel_size ranks on this node (deepinfer/distributed/launch.py): this process is
        rank 0 and runs the scheduler; the others are spawned, so a script that builds such an LLM needs
        an `if __name__ == "__main__":` guard. Steps are synchronous and eager for now."""
        from deepinfer.distributed.launch import TPEngine

        self._start_engine(ref, "tensor_parallel_size", TPEngine)

    def _start_context_parallel(self, ref: str) -> None:
        """context_parallel_size ranks on this node, each holding the whole model and cache: a step that is
        one request's prefill chunk of at least 2 * cp compression windows is split over them (zig-zag,
        deepinfer/distributed/context_parallel.py); every other step runs on every rank alike. DeepSeek-V4
        only so far. This process is rank 0 (`if __name__ == "__main__":` guard); synchronous and eager."""
        from deepinfer.distributed.launch import TPEngine

        self._start_engine(ref, "context_parallel_size", TPEngine)

    def _start_data_parallel(self, ref: str) -> None:
        """data_parallel_size ranks on this node (deepinfer/distributed/dp_engine.py), each with its own
        requests, scheduler and cache; with enable_expert_parallel the routed experts are spread over
        them (enable_eplb: rebalanced while serving, `eplb_config` or EPLBConfig's defaults), else every rank holds them
        all. This process is rank 0 and schedules every rank; the others are spawned (`if __name__ ==
        "__main__":` guard). Steps are synchronous and eager for now."""
        from deepinfer.distributed.dp_engine import DPEngine, EPLBConfig

        eplb = _eplb_settings(self.config, EPLBConfig) if self.config.enable_eplb else None
        self._start_engine(ref, "data_parallel_size", lambda args, detok: DPEngine(args, detok, eplb))

    def _start_engine(self, ref: str, size: str, engine) -> None:
        """A multi-process engine (`engine(EngineArgs, detokenizer)`) for this LLM's config; `size` names
        the parallel size that asked for it."""
        from deepinfer.distributed.launch import EngineArgs
        from deepinfer.distributed.parallel_state import ParallelConfig
        from deepinfer.loader.model_config import read_model_config
        from deepinfer.loader.model_loader import meta_model

        cfg = self.config
        if cfg.engram_device is not None:
            raise ValueError(f"engram_device: host-resident Engram tables are not supported with {size} > 1 yet "
                             "(every rank holds the tables on its device)")
        if cfg.async_scheduling or not cfg.enforce_eager:
            logger.info("%s=%d: steps run synchronously and without CUDA graphs (not yet validated across ranks)",
                        size, getattr(cfg, size))
        repack: list[bool] = []  # FP4 experts held as FP8 codes on every rank: decided before any rank starts
        self.model_dir, checked = _resolve_checked(cfg, ref, lambda meta: repack.append(_check_ranks_fit(cfg, meta)))
        if not checked and cfg.device.startswith("cuda"):
            repack.append(_check_ranks_fit(cfg, meta_model(self.model_dir, dtype=getattr(torch, cfg.dtype),
                                                           quantized=cfg.keeps_checkpoint_formats,
                                                           load_format=cfg.load_format)))
        self.detokenizer = None if cfg.skip_tokenizer_init else _load_detokenizer(self.model_dir)
        keep = _replay_keep(cfg, read_model_config(self.model_dir))
        parallel = ParallelConfig(tensor_parallel_size=cfg.tensor_parallel_size,
                                  data_parallel_size=cfg.data_parallel_size,
                                  enable_expert_parallel=cfg.enable_expert_parallel,
                                  context_parallel_size=cfg.context_parallel_size)
        args = EngineArgs(str(self.model_dir), parallel, device=cfg.device, dtype=cfg.dtype,
                          quantized=cfg.keeps_checkpoint_formats, kv_cache_dtype=cfg.kv_cache_dtype,
                          kv_cache_memory=cfg.kv_cache_memory, max_model_len=cfg.max_model_len,
                          max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                          block_size=cfg.block_size, seed=cfg.seed, replay_keep=keep,
                          batch_invariant=cfg.batch_invariant, load_format=cfg.load_format,
                          repack_fp4_experts=bool(repack and repack[0]))
        self.engine = engine(args, self.detokenizer)
        self._owned.append(self.engine)
        self.model, self.scheduler = self.engine.model, self.engine.scheduler
        self.max_model_len = self.engine.max_model_len
        _log_capacity(self.model, self.engine.cache, self.scheduler.kv, self.max_model_len, cfg,
                      self.engine.rank_weights)

    def get_metrics(self) -> dict:
        """Counters since start-up: speculative decoding's (vLLM's names: num_drafts, num_draft_tokens,
        num_accepted_tokens, accepted_per_position, mean_acceptance_length, which counts the target's
        own token) and num_preemptions."""
        from deepinfer.spec.ngram import SpecStats

        sched = self.scheduler
        return {**getattr(sched, "spec_stats", SpecStats()).as_dict(),
                "num_preemptions": getattr(sched, "num_preemptions", 0)}

    def close(self) -> None:
        """Stop the other ranks of a multi-process engine (leaving its process group, so that this process
        can start another) and the grammar compile threads. A closed LLM serves no more requests; closing
        again does nothing. Also done when the LLM is garbage-collected, at interpreter exit, and on
        leaving a `with LLM(...) as llm:` block."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs all prompts to completion; outputs come back in prompt order. Every prompt and
        parameter is validated before anything is scheduled (ValueError naming the field).

        If a model step fails, the requests it computed are aborted and the rest run to the end;
        then GenerationError is raised, naming the aborted prompts, with every output in its
        `outputs` (aborted ones have finish_reason "abort" and `error`). If generate itself is
        interrupted (KeyboardInterrupt, ...), its requests are aborted and freed before the
        exception propagates. Either way the engine then serves as a fresh one would."""
        self._check_open()
        prompts = _as_prompt_list(prompts)
        params = self._params_for(prompts, sampling_params)
        inputs = [self._prepare(i, p) for i, p in enumerate(prompts)]
        for i, ((ids, _), sp) in enumerate(zip(inputs, params)):
            self._check_params(i, sp, ids)
        groups = [self._submit(ids, sp, images) for (ids, images), sp in zip(inputs, params)]
        try:
            self._run(sum(len(g) for g in groups), use_tqdm)
        except BaseException:
            reqs = [r for g in groups for r in g]
            self.engine.abort([r.request_id for r in reqs], "generate was interrupted")
            for r in reqs:
                self.engine.release(r)
            raise
        outs = [RequestOutput(g[0].request_id, _text_of(p), ids,
                              [self.engine.completion(r, k) for k, r in enumerate(g)],
                              prompt_logprobs=g[0].prompt_logprobs)
                for g, p, (ids, _) in zip(groups, prompts, inputs)]
        failed = [(i, c) for i, o in enumerate(outs) for c in o.outputs if c.finish_reason == "abort"]
        if failed:
            raise GenerationError(failed, outs)
        return outs

    # incremental serving (deepinfer serve's engine-core process): add requests, step, read each
    # request's output_token_ids / logprobs as they grow, abort; generate() is built on the same parts

    def add_request(self, prompt: PromptType, params: SamplingParams) -> list[Request]:
        """Validate one prompt and its parameters (ValueError naming the field, nothing queued on
        error) and queue it; returns its params.n Requests, the leader first."""
        self._check_open()
        ids, images = self._prepare(0, prompt)
        self._check_params(0, params, ids)
        return self._submit(ids, params, images)

    def step(self) -> list[Request]:
        """One engine step; returns the requests it finished (their detokenizer state released)."""
        finished = self.engine.step()
        for r in finished:
            self.engine.release(r)
        return finished

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def abort(self, requests: list[Request], error: str) -> list[Request]:
        """Finish these requests (reason "abort") and free their slots and blocks now."""
        done = self.engine.abort([r.request_id for r in requests], error)
        for r in requests:
            self.engine.release(r)
        return done

    def cache_stats(self) -> dict:
        """Scheduler and cache occupancy: waiting / running requests, free and total slots and blocks."""
        sched = self.scheduler
        kv = sched.kv
        slots, blocks = kv.num_free()
        return {"num_waiting": len(sched.waiting), "num_running": len(sched.running),
                "free_slots": slots, "total_slots": kv.num_slots,
                "free_blocks": sum(blocks.values()), "total_blocks": sum(kv.num_blocks.values())}

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this LLM is closed (LLM.close() or the end of its `with` block); build a new one")

    def _check_params(self, i: int, sp: SamplingParams, ids: list[int]) -> None:
        """What SamplingParams cannot check alone: limits that depend on the model, engine and prompt (`ids`)."""
        vocab = self.model.config.vocab_size
        limit = min(self.config.max_logprobs, vocab)
        if sp.stop and self.detokenizer is None:
            raise ValueError(f"prompts[{i}]: SamplingParams.stop needs a tokenizer (skip_tokenizer_init=True)")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(sp, name)
            if k is not None and k > limit:
                raise ValueError(f"prompts[{i}]: SamplingParams.{name} {k} is above the limit {limit} "
                                 f"(max_logprobs={self.config.max_logprobs}, vocab_size={vocab})")
        if sp.prompt_logprobs is not None:
            self._check_prompt_logprobs(i)
        bad = [t for t in sp.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"prompts[{i}]: SamplingParams.stop_token_ids {bad[:5]} are outside the vocabulary "
                             f"[0, {vocab})")
        if sp.so_args is not None:
            try:
                backend = self._grammar_backend()
                key = backend.validate(sp.so_args)
                backend.check_prefix(key, ids, sp.so_prefix_tokens)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: SamplingParams.{e}") from None

    def _check_prompt_logprobs(self, i: int) -> None:
        """prompt_logprobs are computed by the single-process runner's prefill (worker/model_runner.py); the
        engines that do not compute them refuse the request rather than return nothing."""
        cfg = self.config
        parallel = [n for n in ("tensor_parallel_size", "data_parallel_size", "context_parallel_size")
                    if getattr(cfg, n) > 1]
        if parallel:
            raise ValueError(f"prompts[{i}]: SamplingParams.prompt_logprobs is not supported with {parallel[0]} > 1 "
                             "yet")

    def _grammar_backend(self):
        """The structured-output backend (xgrammar, compiled from the model's tokenizer), built once."""
        cfg = self.config
        if self.detokenizer is None:
            raise ValueError("so_args: structured outputs need the model's tokenizer (skip_tokenizer_init=True)")
        parallel = [n for n in ("tensor_parallel_size", "data_parallel_size", "context_parallel_size")
                    if getattr(cfg, n) > 1]
        if parallel:
            raise ValueError(f"so_args: structured outputs are not supported with {parallel[0]} > 1 yet")
        if self._grammars is None:
            from deepinfer.structured import GrammarBackend

            mcfg = self.model.config
            self._grammars = GrammarBackend(self.model_dir / "tokenizer.json", mcfg.vocab_size, [mcfg.eos_token_id])
            self._owned.append(self._grammars)
        return self._grammars

    def _prepare(self, i: int, prompt: PromptType) -> tuple[list[int], list]:
        """Token ids (image placeholders expanded) and [(span start, preprocessed image)]."""
        if not isinstance(prompt, dict):
            return self._tokenize(i, prompt), []
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "images"}
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError(f"prompts[{i}]: a dict prompt needs exactly one of 'prompt' / 'prompt_token_ids' "
                             f"(and optionally 'images'); got keys {sorted(prompt)}")
        ids = self._tokenize(i, prompt.get("prompt", prompt.get("prompt_token_ids")))
        images = prompt.get("images") or []
        if not isinstance(images, (list, tuple)):
            raise ValueError(f"prompts[{i}].images: expected a list of images, got {type(images).__name__}")
        if not images:
            return ids, []
        from deepinfer.models.image_processor_v41 import expand_image_placeholders, preprocess_image

        cfg = self.model.config
        if not hasattr(self.model, "vision"):
            raise ValueError(f"prompts[{i}]: images given, but this model has no vision encoder")
        processed = []
        for j, img in enumerate(images):
            try:  # anything an image can raise while decoding is this prompt's error, found before scheduling
                processed.append(preprocess_image(img, cfg.vision))
            except Exception as e:
                raise ValueError(f"prompts[{i}].images[{j}]: cannot be read as an image "
                                 f"({type(e).__name__}: {e})") from None
        try:
            ids, starts = expand_image_placeholders(ids, processed, cfg.image_token_id)
        except ValueError as e:
            raise ValueError(f"prompts[{i}].images: {e}") from None
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompts[{i}]: {len(ids)} tokens with the image spans; max_model_len is "
                             f"{self.max_model_len}")
        return ids, list(zip(starts, processed))

    def _params_for(self, prompts: list, sp) -> list[SamplingParams]:
        if sp is None:
            sp = SamplingParams()
        if isinstance(sp, SamplingParams):
            return [sp] * len(prompts)
        sp = list(sp)
        if len(sp) != len(prompts):
            raise ValueError(f"sampling_params: {len(sp)} given for {len(prompts)} prompts")
        return sp

    def _tokenize(self, i: int, prompt: PromptType) -> list[int]:
        where = f"prompts[{i}]"
        if not isinstance(prompt, (str, list, tuple)):
            raise ValueError(f"{where}: a prompt is a str, a list of token ids or a dict; got "
                             f"{type(prompt).__name__}")
        if isinstance(prompt, str):
            if self.detokenizer is None:
                raise ValueError(f"{where}: text prompts need a tokenizer; pass token ids with skip_tokenizer_init")
            if not prompt:
                raise ValueError(f"{where}: the prompt is empty")
            ids = self.detokenizer.encode(prompt, self.model.config.bos_token_id)
        else:
            ids = list(prompt)
            if not ids:
                raise ValueError(f"{where}: the prompt is empty")
            vocab = self.model.config.vocab_size
            notint = [t for t in ids if not _is_token(t)]
            if notint:
                raise ValueError(f"{where}: prompt_token_ids must be integers; got {notint[:5]!r}")
            ids = [int(t) for t in ids]
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{where}: prompt_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"{where}: the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             "(one more token must fit)")
        return ids

    def _submit(self, ids: list[int], sp: SamplingParams, images: list) -> list[Request]:
        eos = self.model.config.eos_token_id
        reqs = [Request(f"{next(self._ids)}", ids, sp, eos, images=images, sample_index=j) for j in range(sp.n)]
        leader = reqs[0]
        if sp.prompt_logprobs is not None:  # position 0 stays None: nothing predicts it
            leader.prompt_logprobs = [None] * len(ids)
        if sp.so_args is not None:  # compiled on a worker thread; the request waits in the queue until it is
            backend = self._grammar_backend()
            k = sp.so_prefix_tokens  # the prompt's last k tokens begin the output (_check_params checked them)
            leader.grammar = backend.request_grammar(backend.validate(sp.so_args), ids[:len(ids) - k])
            if k:
                leader.grammar.begin_with(ids[len(ids) - k:])
        leader.siblings = reqs[1:]  # n > 1: siblings reuse the leader's prompt prefill
        for sib in leader.siblings:
            sib.status = Status.FORKING
        self.engine.add_request(leader)
        return reqs

    def _run(self, total: int, use_tqdm: bool) -> None:
        bar = tqdm(total=total, desc="Processed requests", disable=not use_tqdm)
        while self.engine.has_unfinished():
            bar.update(len(self.engine.step()))
        bar.close()


class GenerationError(RuntimeError):
    """Some requests of a generate call were aborted by a failing model step. `outputs` holds every
    prompt's RequestOutput, in order; `failed` the (prompt index, aborted CompletionOutput) pairs."""

    def __init__(self, failed: list[tuple[int, CompletionOutput]], outputs: list[RequestOutput]):
        self.failed, self.outputs = failed, outputs
        names = "; ".join(f"prompts[{i}] (sample {c.index}): {c.error}" for i, c in failed[:5])
        more = f"; and {len(failed) - 5} more" if len(failed) > 5 else ""
        super().__init__(f"{len(failed)} request(s) aborted by a failing step: {names}{more}. "
                         "Their outputs have finish_reason 'abort'; every output is in this error's .outputs")


def _release(owned: list) -> None:
    """An LLM's finalizer: close what it owns, last acquired first (every one, even after one raised)."""
    if owned:
        try:
            owned.pop().close()
        finally:
            _release(owned)


def _as_prompt_list(prompts) -> list:
    """One prompt (a str, a dict, a list of token ids) or a sequence of them, as a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                             and _is_token(prompts[0])):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts: expected a str, a list of token ids, a dict or a list of those; "
                         f"got {type(prompts).__name__}")
    return list(prompts)


def _is_token(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _text_of(prompt: PromptType) -> str | None:
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _eplb_settings(cfg: EngineConfig, make):
    """dp_engine.EPLBConfig from vLLM's eplb_config keys: step_interval, window_size, and
    num_redundant_experts in all (spread evenly: a multiple of data_parallel_size)."""
    given, kw = cfg.eplb_config or {}, {}
    if "step_interval" in given:
        kw["interval"] = given["step_interval"]
    if "window_size" in given:
        kw["window"] = given["window_size"]
    if "num_redundant_experts" in given:
        n, dp = given["num_redundant_experts"], cfg.data_parallel_size
        if n % dp:
            raise ValueError(f"eplb_config.num_redundant_experts: {n} is not a multiple of data_parallel_size={dp} "
                             "(every rank holds the same number of expert slots)")
        kw["redundant_per_rank"] = n // dp
    return make(**kw)


def _calibration(model_dir):
    """The draft's confidence temperatures (dspark_calibration.json in the checkpoint), or None."""
    from deepinfer.spec.calibration import CALIBRATION_FILE, Calibration

    path = Path(model_dir) / CALIBRATION_FILE
    return Calibration.load(path).temperatures if path.exists() else None


def _proposer(cfg: EngineConfig, mcfg):
    """The draft proposer `speculative_config` names, or None. `num_speculative_tokens` (no
    speculative_config) takes the checkpoint's own draft layers: DSpark stages ("dspark") or V4's MTP
    layer ("mtp")."""
    from deepinfer.spec.ngram import ModelDrafts, NgramProposer

    sc = cfg.speculation
    if sc is None:
        return None
    if sc["method"] == "ngram":
        return NgramProposer(sc["num_speculative_tokens"], sc.get("prompt_lookup_max", 4),
                             sc.get("prompt_lookup_min", 1))
    k = sc["num_speculative_tokens"]
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative_config.num_speculative_tokens: must be a positive integer, got {k!r}")
    method = "mtp" if sc["method"] == "deepseek_mtp" else sc["method"]
    if cfg.speculative_config is None and mcfg.num_nextn_predict_layers and not mcfg.has_dspark:
        method = "mtp"
    return ModelDrafts(method, k)


def _require_one_process(cfg: EngineConfig) -> None:
    """The one place that turns down parallel layouts this build cannot launch yet. It runs a
    tensor-parallel group (LLM._start_tensor_parallel), or data-parallel ranks with tensor_parallel_size
    1, their routed experts spread over them with enable_expert_parallel (+ enable_eplb) or replicated
    (LLM._start_data_parallel), or context-parallel ranks alone (LLM._start_context_parallel); not TP
    inside DP ranks, CP beside TP or DP, or EP without DP."""
    changed = cfg.parallel_changes()
    refused = {}
    if cfg.context_parallel_size > 1 and (cfg.tensor_parallel_size > 1 or cfg.data_parallel_size > 1):
        refused |= {k: changed[k] for k in ("context_parallel_size", "tensor_parallel_size", "data_parallel_size")
                    if k in changed}
    if cfg.data_parallel_size > 1 and cfg.tensor_parallel_size > 1:
        refused |= {k: changed[k] for k in ("data_parallel_size", "tensor_parallel_size")}
    if cfg.enable_expert_parallel and cfg.data_parallel_size == 1:
        refused |= {k: v for k, v in changed.items() if k in ("enable_expert_parallel", "enable_eplb")}
    if cfg.speculation is not None and changed:
        refused |= dict(changed, speculative_config=cfg.speculation)
    if refused:
        names = ", ".join(f"{k}={v!r}" for k, v in refused.items())
        raise ValueError(f"{names}: not yet supported in this build: deepinfer runs one process, a "
                         "tensor-parallel group (tensor_parallel_size), or data-parallel ranks (data_parallel_size, "
                         "tensor_parallel_size=1) with enable_expert_parallel / enable_eplb, or context-parallel "
                         "ranks alone (context_parallel_size)")


def _check_before_load(cfg: EngineConfig, meta: torch.nn.Module) -> bool:
    """What can be refused from the model built on the meta device, before any weight is read: a
    quantization the checkpoint does not have, and a model that does not fit the GPU's free memory as
    shipped. -> whether its FP4 routed experts are to be held as FP8 codes: on CUDA with bf16
    activations, where that larger model still fits (the faster kernel; Experts.repack_fp4_as_fp8)."""
    mcfg = meta.config
    if cfg.quantization == "fp8" and mcfg.quant.block_size is None:
        raise ValueError("quantization: 'fp8' keeps the checkpoint's FP8/FP4 weights, but this checkpoint's "
                         "config.json has no quantization_config (its weights are not quantised); leave "
                         "quantization unset or pass 'none'")
    if not cfg.device.startswith("cuda"):
        # host memory is not checked: the CPU path is the torch reference for test-sized models, and what
        # the host has "available" (page cache, memory-mapped shards, other processes) is no fixed bound
        return False
    device = torch.device(cfg.device)
    free, _ = torch.cuda.mem_get_info(device)
    weights, reserve = weight_bytes(meta, cfg.engram_device == "cpu"), _fit_reserve(cfg, mcfg)
    try:
        check_fit(weights, free, reserve, f"{cfg.device} ({torch.cuda.get_device_name(device)})")
    except ValueError as e:
        tables = weights.other - weight_bytes(meta, host_engram=True).other
        if not tables:
            raise
        raise ValueError(f"{e}. engram_device='cpu' keeps the {format_bytes(tables)} of Engram tables on the host, "
                         "memory-mapped") from None
    return cfg.dtype == "bfloat16" and repack_fits(weights, free, reserve)


def _resolve_checked(cfg: EngineConfig, ref: str, check: Callable[[torch.nn.Module], object]) -> tuple[Path, bool]:
    """(the model's directory, whether `check` ran). A hub checkpoint not yet cached whole comes in two
    parts: its small files (config.json, shard index, tokenizer), then, once `check` passed on the model
    built from them on the meta device, its weight shards; a model that cannot fit fails before they are
    downloaded. Other directories are returned as found, unchecked (load_model checks them before any
    weight is read). max_model_len is checked against config.json first, on every path."""
    from types import SimpleNamespace

    from deepinfer.loader.model_config import read_model_config
    from deepinfer.loader.model_loader import model_spec
    from deepinfer.loader.resolve import fetch_weights, has_weights, resolve_model_dir, weight_index

    path = resolve_model_dir(ref, hf_model_dir=cfg.hf_model_dir, offline=cfg.hf_hub_offline, weights=False)
    _check_max_model_len(cfg, read_model_config(path))
    if has_weights(path) or cfg.load_format == "dummy":  # dummy: config.json is all it reads
        return path, False
    index = weight_index(path)  # without one (a single-file checkpoint) the tensor names need the weights
    if index is not None:
        mcfg, model_cls, extra, _ = model_spec(path, SimpleNamespace(names=index.keys), cfg.engram_device)
        with torch.device("meta"):
            check(model_cls(mcfg, dtype=getattr(torch, cfg.dtype), quantized=cfg.keeps_checkpoint_formats, **extra))
    return fetch_weights(ref, path, offline=cfg.hf_hub_offline), index is not None


def _check_max_model_len(cfg: EngineConfig, mcfg) -> None:
    """max_model_len within the model's max_position_embeddings (config.json: for V4 / V4.1 the context their
    YaRN rope scaling was trained to, original_max_position_embeddings x factor); above it only with
    allow_long_max_model_len (DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN=1), as vLLM does."""
    asked, limit = cfg.max_model_len, mcfg.max_position_embeddings
    if asked is None or asked <= limit:
        return
    if not cfg.allow_long_max_model_len:
        raise ValueError(f"max_model_len: {asked} is above the model's max_position_embeddings {limit} (config.json); "
                         f"use at most {limit}, or set DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN=1 to run past "
                         "the positions the model was trained on")
    logger.warning("max_model_len=%d is above the model's max_position_embeddings %d "
                   "(DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN=1): outputs past %d tokens may be wrong", asked, limit, limit)


def _check_ranks_fit(cfg: EngineConfig, meta: torch.nn.Module) -> bool:
    """Before any rank starts or reads a weight: each GPU's share of the model (`meta`, built on the meta
    device) against the least free memory among the GPUs the ranks take. The routed experts are split over
    the data-parallel ranks with expert parallelism, over the tensor-parallel ranks by range; the rest
    is counted whole on every rank (an upper bound under TP, whose attention heads are split too).
    -> whether the ranks hold packed FP4 experts as FP8 codes (as _check_before_load: bf16 activations,
    where every rank's repacked share still fits)."""
    if not cfg.device.startswith("cuda"):
        return False  # as _check_before_load: host memory is no fixed bound
    ways = cfg.data_parallel_size if cfg.enable_expert_parallel else cfg.tensor_parallel_size
    world = cfg.tensor_parallel_size * cfg.data_parallel_size * cfg.context_parallel_size
    gpus = list(range(min(world, torch.cuda.device_count())))
    free, worst = min((torch.cuda.mem_get_info(i)[0], i) for i in gpus)
    layout = ", ".join(f"{k}={v!r}" for k, v in cfg.parallel_changes().items())
    weights, reserve = weight_bytes(meta), _fit_reserve(cfg, meta.config)
    check_fit(weights, free, reserve,
              f"cuda:{worst} ({torch.cuda.get_device_name(worst)}, the least free of {len(gpus)} GPU(s))", ways, layout)
    return cfg.dtype == "bfloat16" and repack_fits(weights, free, reserve, ways)


def _fit_reserve(cfg: EngineConfig, mcfg) -> int:
    """Bytes a device keeps beside the weights: kv_cache_memory when given, else the cache of one request
    at the expected length (the least the engine starts with), plus WORKSPACE_BYTES for activations."""
    if cfg.kv_cache_memory:
        return cfg.kv_cache_memory + WORKSPACE_BYTES
    spec = cache_spec(mcfg, cfg.kv_cache_dtype, cfg.block_size)
    per_token = sum(b / (cfg.block_size * m) for m, b in spec.block_bytes.items())
    expected = cfg.max_model_len or min(mcfg.max_position_embeddings, 4096)
    return int(spec.slot_bytes + expected * per_token) + WORKSPACE_BYTES


def _log_capacity(model: torch.nn.Module, cache, kv: KVCacheManager, max_model_len: int, cfg: EngineConfig,
                  ranks: list[WeightBytes] | None = None) -> None:
    """Start-up figures: the weights as held on the device, the cache, and how many requests of
    max_model_len tokens fit in it at once. `ranks`: a multi-process engine's weights on each rank (one
    line each; `model`, `cache` and `kv` are the driver's, the same formats and cache sizes as every rank's)."""
    weights = ranks or [weight_bytes(model, cfg.engram_device == "cpu")]
    cache_bytes = sum(c.nbytes() for c in cache.layers + cache.mtp)
    if cache.token_history is not None:
        cache_bytes += cache.token_history.numel() * cache.token_history.element_size()
    fit = requests_at_length(kv.num_slots, kv.num_blocks, kv.blocks_for(max_model_len))
    formats = "as the checkpoint stores them" if cfg.keeps_checkpoint_formats else f"dequantised to {cfg.dtype}"
    if any(getattr(m, "w1", None) is not None and m.w1.dtype == torch.float8_e4m3fn and m.quant.fp4_experts
           for m in model.modules() if isinstance(m, Experts)):
        formats += "; FP4 routed experts held as FP8 codes (twice their bytes, faster kernels: they fit)"
    if cfg.load_format == "dummy":
        formats = "random values, load_format='dummy'; " + formats
    for rank, w in enumerate(weights):
        logger.info("%sweights: %s on %s (%s; routed experts %s)", f"rank {rank} " if ranks else "",
                    format_bytes(w.total), cfg.device, formats, format_bytes(w.experts))
    dp = cfg.data_parallel_size  # each data-parallel rank serves its own requests
    logger.info("cache: %s%s (%d request slots); %d request(s) of max_model_len=%d tokens fit at once%s",
                format_bytes(cache_bytes), " on each rank" if ranks else "", kv.num_slots, fit, max_model_len,
                f" on each of the {dp} data-parallel ranks" if dp > 1 else "")


def _replay_keep(cfg: EngineConfig, mcfg) -> int | None:
    """Rows kept by SWA bounded replay; they must cover the window plus the longest draft
    backtrack (a rejected DSpark block), or the rings handed to decoding would have holes.
    `mcfg`: the model's config, read as models/interface.py ModelConfig declares it."""
    if cfg.yoco_prefill_truncation_mode == "none":
        return None
    keep = cfg.yoco_prefill_keep_tokens
    need = mcfg.sliding_window + (mcfg.dspark_block_size or 0)
    if keep < need:
        raise ValueError(f"yoco_prefill_keep_tokens: {keep} rows do not cover the sliding window "
                         f"({mcfg.sliding_window}) plus the draft block ({need - mcfg.sliding_window}); need >= {need}")
    return keep


def _load_detokenizer(model_dir) -> Detokenizer:
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {model_dir} (pass skip_tokenizer_init=True for token-id prompts)")
    return Detokenizer(Tokenizer.from_file(str(path)))
