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
from deepinfer.engine.detokenizer import Detokenizer, bad_words_token_ids
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.memory_fit import (WORKSPACE_BYTES, WeightBytes, check_fit, format_bytes, repack_fits,
                                         requests_at_length)
from deepinfer.engine.outputs import CompletionOutput, RequestOutput
from deepinfer.engine.request import Request, Status
from deepinfer.engine.scheduler import VarlenPolicy
from deepinfer.layers.moe import Experts
from deepinfer.loader.model_loader import weight_bytes
from deepinfer.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams
from deepinfer.tools.demo import resolve_demo
from deepinfer.worker.kv_cache import cache_spec
from deepinfer.worker.sps_profile import profile_sps, profile_step_times

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
        self.config = cfg
        # what close() releases (the engine's ranks, the grammar threads), last acquired first; the
        # finalizer holds this list and never the LLM, so dropping the LLM, or interpreter exit, closes it
        self._owned: list = []
        self._finalizer = weakref.finalize(self, _release, self._owned)
        ref = cfg.model or cfg.hf_model_dir or DEFAULT_MODEL
        ref = resolve_demo(ref) or ref
        self._ids = itertools.count()
        self._grammars = None  # structured outputs: built at the first request with so_args
        self._build(ref)
        # the start-up heap (weights' Python objects, tokenizer, configs) is never garbage: moving it out
        # of the collector's generations keeps full collections from pausing steps
        gc.collect()
        gc.freeze()

    def _build(self, ref: str) -> None:
        """The engine for this LLM's config, on every layout the same way: checks before any weight is read
        (quantization, the model's share of each GPU), the tokenizer, then an Engine over one rank in this
        process (world size 1) or the multi-process executor's ranks (tensor / data / context parallel sizes;
        this process is rank 0 and spawns the others, so a script that builds one needs an
        `if __name__ == "__main__":` guard; multi-node: nnodes > 1, and every other node runs run_node)."""
        from deepinfer.executor.engine import start_engine
        from deepinfer.executor.worker import EngineArgs
        from deepinfer.loader.model_config import read_model_config
        from deepinfer.loader.model_loader import meta_model

        cfg = self.config
        if cfg.node_rank != 0:
            raise ValueError(f"node_rank: LLM runs the engine's driver, on node 0; node {cfg.node_rank} only runs ranks: "
                             f"start it with `deepinfer serve <the same flags> --node-rank {cfg.node_rank}` (or "
                             "deepinfer.llm.run_worker_node)")
        world = cfg.tensor_parallel_size * cfg.data_parallel_size * cfg.context_parallel_size
        check = _check_before_load if world == 1 else _check_ranks_fit
        repack: list[bool] = []  # FP4 experts held as FP8 codes: decided before any weight is read
        self.model_dir, checked = _resolve_checked(cfg, ref, lambda meta: repack.append(check(cfg, meta)))
        if not checked:
            repack.append(check(cfg, meta_model(self.model_dir, dtype=getattr(torch, cfg.dtype),
                                                quantized=cfg.keeps_checkpoint_formats,
                                                engram_device=cfg.engram_device, load_format=cfg.load_format)))
        self.detokenizer = None if cfg.skip_tokenizer_init else _load_detokenizer(self.model_dir)
        mcfg = read_model_config(self.model_dir)
        proposer = _proposer(cfg, mcfg)
        args = EngineArgs(**_engine_args(cfg, proposer), model_dir=str(self.model_dir),
                          replay_keep=_replay_keep(cfg, mcfg), repack_fp4_experts=bool(repack and repack[0]))
        self.engine = start_engine(args, self.detokenizer, proposer and (lambda: _proposer(cfg, mcfg)),
                                   cfg.async_scheduling)
        self._owned.append(self.engine)
        self.model, self.scheduler, self.max_model_len = self.engine.model, self.engine.scheduler, \
            self.engine.max_model_len
        if cfg.enable_mtp_varlen:
            self._start_varlen(args)
        _log_capacity(self.model, self.engine.cache, self.scheduler.kv, self.max_model_len, cfg,
                      self.engine.rank_weights if world > 1 else None)

    def _start_varlen(self, args) -> None:
        """Confidence-scheduled verification: every replica's scheduler trades drafts against a steps-per-second
        table measured now, through replica 0's steps."""
        if args.speculation is None or args.speculation[0] not in ("dspark", "mtp"):
            raise ValueError("enable_mtp_varlen: confidence-scheduled verification needs the model's own draft "
                             "layers (speculative_config method 'dspark' or 'mtp', or num_speculative_tokens)")
        kv = self.scheduler.kv
        if not self.engine.cuda_graphs:  # per-request lengths (Alg. 1): an eager step costs its tokens
            most = self.scheduler.max_num_seqs * (args.ring_slack + 1)  # every request verifying all its drafts
            policy = VarlenPolicy(profile_sps(self.engine.profile_runner(), kv, args.max_num_batched_tokens, most),
                                  _calibration(self.model_dir))
        else:  # graphs pad every request to the step's longest: one length a step, over times by (requests, drafts)
            times = profile_step_times(self.engine.profile_runner(), kv, args.speculation[1],
                                       min(self.scheduler.max_num_seqs, kv.num_slots), args.max_num_batched_tokens)
            policy = VarlenPolicy(None, _calibration(self.model_dir), times)
        for sched in self.engine.schedulers:
            sched.varlen = policy

    def get_metrics(self) -> dict:
        """Counters since start-up: speculative decoding's (vLLM's names: num_drafts, num_draft_tokens,
        num_accepted_tokens, accepted_per_position, mean_acceptance_length, which counts the target's
        own token) and num_preemptions."""
        from deepinfer.spec.ngram import SpecStats

        total = SpecStats()  # over the data-parallel replicas' schedulers
        for st in (s.spec_stats for s in self.engine.schedulers):
            total.num_drafts += st.num_drafts
            total.num_draft_tokens += st.num_draft_tokens
            total.num_accepted_tokens += st.num_accepted_tokens
            for mine, theirs in ((total.accepted_per_position, st.accepted_per_position),
                                 (total.drafted_per_position, st.drafted_per_position)):
                mine += [0] * (len(theirs) - len(mine))
                for j, n in enumerate(theirs):
                    mine[j] += n
        return {**total.as_dict(), "num_preemptions": sum(s.num_preemptions for s in self.engine.schedulers)}

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
                              prompt_logprobs=g[0].prompt_logprobs, prompt_logprob_ranks=g[0].prompt_logprob_ranks)
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
        if sp.bad_words:
            if self.detokenizer is None:
                raise ValueError(f"prompts[{i}]: SamplingParams.bad_words needs a tokenizer "
                                 "(skip_tokenizer_init=True); give bad_words_token_ids instead")
            words = bad_words_token_ids(sp.bad_words, self.detokenizer)
            sp.bad_words_token_ids = words + [w for w in sp.bad_words_token_ids or () if w not in words]
            long = [w for w in sp.bad_words_token_ids if len(w) > MAX_BAD_WORD_TOKENS]
            if long:
                raise ValueError(f"prompts[{i}]: SamplingParams.bad_words: a word of {len(long[0])} tokens; each may "
                                 f"be at most {MAX_BAD_WORD_TOKENS}")
        for name, tokens in (("stop_token_ids", sp.stop_token_ids), ("logit_bias", sp.logit_bias or ()),
                             ("allowed_token_ids", sp.allowed_token_ids or ()),
                             ("bad_words_token_ids", [t for w in sp.bad_words_token_ids or () for t in w])):
            bad = [t for t in tokens if t >= vocab]
            if bad:
                raise ValueError(f"prompts[{i}]: SamplingParams.{name} {bad[:5]} are outside the vocabulary "
                                 f"[0, {vocab})")
        if sp.so_args is not None:
            try:
                backend = self._grammar_backend()
                key = backend.validate(sp.so_args)
                backend.check_prefix(key, ids, sp.so_prefix_tokens)
            except ValueError as e:
                raise ValueError(f"prompts[{i}]: SamplingParams.{e}") from None

    def _grammar_backend(self):
        """The structured-output backend (xgrammar, compiled from the model's tokenizer), built once."""
        if self.detokenizer is None:
            raise ValueError("so_args: structured outputs need the model's tokenizer (skip_tokenizer_init=True)")
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
        if not self.model.supports_images:
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
            leader.prompt_logprob_ranks = [None] * len(ids)
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
    """expert_shard.EPLBConfig from vLLM's eplb_config keys: step_interval, window_size, and
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


def _engine_args(cfg: EngineConfig, proposer) -> dict:
    """EngineArgs' fields that come from the config as they are (the rest: the model's directory, bounded
    replay, the FP4 repack decision). A multi-process engine's ranks share one sampling seed (each rank samples
    the tokens its next steps read): a random one when none is set."""
    from deepinfer.distributed.expert_shard import EPLBConfig
    from deepinfer.distributed.parallel_state import ParallelConfig

    world = cfg.tensor_parallel_size * cfg.data_parallel_size * cfg.context_parallel_size
    seed = cfg.seed if cfg.seed is not None or world == 1 else int(torch.randint(0, 2**31 - 1, ()).item())
    return dict(parallel=ParallelConfig(tensor_parallel_size=cfg.tensor_parallel_size,
                                        data_parallel_size=cfg.data_parallel_size,
                                        enable_expert_parallel=cfg.enable_expert_parallel,
                                        context_parallel_size=cfg.context_parallel_size),
                device=cfg.device, dtype=cfg.dtype, quantized=cfg.keeps_checkpoint_formats,
                load_format=cfg.load_format, engram_device=cfg.engram_device, kv_cache_dtype=cfg.kv_cache_dtype,
                kv_cache_memory=cfg.kv_cache_memory, max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens, block_size=cfg.block_size, seed=seed,
                batch_invariant=cfg.batch_invariant, enforce_eager=cfg.enforce_eager,
                speculation=None if proposer is None else (proposer.method, proposer.num_speculative_tokens),
                eplb=_eplb_settings(cfg, EPLBConfig) if cfg.enable_eplb else None, nnodes=cfg.nnodes,
                node_rank=cfg.node_rank, master_addr=cfg.master_addr, master_port=cfg.master_port,
                distributed_executor_backend=cfg.distributed_executor_backend)


def run_worker_node(model: str | None = None, **options) -> None:
    """Node `node_rank` > 0 of a multi-node engine (the options as node 0's LLM / serve was given them, with its
    own node_rank): runs this node's ranks until node 0's driver closes the engine. The ranks take node 0's
    configuration at start-up (the parallel sizes must agree); `model` is this node's path to the checkpoint."""
    from deepinfer.executor.multiproc import run_node
    from deepinfer.executor.worker import EngineArgs

    cfg = EngineConfig.from_options(model=model, **options)
    if cfg.node_rank == 0:
        raise ValueError("node_rank: node 0 runs the driver: build the LLM (or `deepinfer serve`) there")
    ref = cfg.model or cfg.hf_model_dir or DEFAULT_MODEL
    path, _ = _resolve_checked(cfg, resolve_demo(ref) or ref, lambda meta: None)
    run_node(EngineArgs(**_engine_args(cfg, None), model_dir=str(path)))


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
