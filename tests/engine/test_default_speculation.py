"""llm.default_speculation: a checkpoint whose draft layers run speculates by default on CUDA (DSpark at its block,
MTP one token, confidence-scheduled lengths), and nothing changes without draft layers, when asked otherwise, on
the CPU or under batch invariance."""
import pytest

from deepinfer.config import EngineConfig
from deepinfer.llm import default_speculation
from deepinfer.models.interface import Drafting

BOTH = frozenset({"dspark", "mtp"})
DSPARK = Drafting("dspark", 3, 5, BOTH)
MTP = Drafting("mtp", 1, 1, BOTH)
NONE = Drafting(proposers=BOTH)


def _cfg(**kw) -> EngineConfig:
    return EngineConfig.from_env({}, **{"device": "cuda", **kw})  # an empty environment: no DEEPINFER_* set


@pytest.mark.parametrize("drafting,k", [(DSPARK, 5), (MTP, 1)])
def test_on_by_default_for_a_checkpoint_with_draft_layers(drafting, k):
    cfg = default_speculation(_cfg(), drafting)
    assert cfg.num_speculative_tokens == k and cfg.enable_mtp_varlen and cfg.speculation["num_speculative_tokens"] == k


@pytest.mark.parametrize("cfg,drafting", [
    (_cfg(), NONE),                                          # no draft layers
    (_cfg(), Drafting("dspark", 3, 5, frozenset({"mtp"}))),  # stages whose class does not run them
    (_cfg(num_speculative_tokens=0), DSPARK),                # off when asked (DEEPINFER_USE_NEXTN_DECODE=0)
    (_cfg(num_speculative_tokens=2), DSPARK),                # the user's k, fixed length
    (_cfg(speculative_config={"method": "ngram", "num_speculative_tokens": 3}), DSPARK),
    (_cfg(device="cpu"), DSPARK),                            # eager CPU steps: drafts cannot pay
    (_cfg(batch_invariant=True), DSPARK),                    # fixed lengths could not back off
], ids=["no-stages", "not-run", "zero", "explicit-k", "ngram", "cpu", "batch-invariant"])
def test_unchanged_otherwise(cfg, drafting):
    assert default_speculation(cfg, drafting) == cfg


def test_the_environment_variable_turns_it_off():
    cfg = EngineConfig.from_env({"DEEPINFER_USE_NEXTN_DECODE": "0"}, device="cuda")
    assert default_speculation(cfg, DSPARK).speculation is None
