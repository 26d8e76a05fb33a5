"""Speculative decoding's settings: the algorithms, their SGLang names, and how the flags resolve.

A draft proposes tokens after a request's last one; one verify forward of the target scores them
all, and a draft token is kept iff it equals the token the target samples at that position with
the request's own (seed, position) noise (rollout/core/output_processor.py). Drafts come from
the prompt and output (NGRAM), a draft checkpoint (STANDALONE) or the checkpoint's own MTP layers
(NEXTN; SGLang's EAGLE on such a checkpoint means the same). SGLang's
`--speculative-num-draft-tokens` counts the verified positions of a step including the bonus
token, so a chain of k drafts is `k + 1`, and `--speculative-num-steps` (the draft's depth) is k.
"""
from __future__ import annotations

from typing import Any, Optional

from rollout.value_range import check_range

SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "NEXTN")
# SGLang's names this engine refuses, with the reason
REFUSED_ALGORITHMS = {
    "EAGLE": "EAGLE draft heads are not supported; use NEXTN on a checkpoint with MTP layers, NGRAM, or "
             "STANDALONE with a small draft checkpoint",
    "EAGLE3": "EAGLE3 draft heads are not supported; use NEXTN on a checkpoint with MTP layers, NGRAM, or "
              "STANDALONE with a small draft checkpoint",
}
DEFAULT_NUM_DRAFT_TOKENS = 4          # verified positions per step: 3 drafts + the bonus token
MAX_NUM_DRAFT_TOKENS = 64


def check_speculative(cfg: Any) -> Optional[str]:
    """Validates cfg's speculative_* fields (ValueError naming the field and what it allows);
    returns the algorithm in SGLang's spelling, or None when speculation is off."""
    algo = cfg.speculative_algorithm
    others = {name: getattr(cfg, name) for name in (
        "speculative_num_draft_tokens", "speculative_num_steps", "speculative_eagle_topk",
        "speculative_draft_model_path")}
    if algo is None:
        given = [n for n, v in others.items() if v is not None]
        if given:
            raise ValueError(f"{given[0]}={others[given[0]]!r} needs speculative_algorithm, which is None; "
                             f"set it to one of {SPECULATIVE_ALGORITHMS}")
        return None
    if not isinstance(algo, str):
        raise ValueError(f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS} or None, got {algo!r}")
    name = algo.upper()
    path = cfg.speculative_draft_model_path
    if name == "EAGLE" and path in (None, cfg.model_path):
        name = "NEXTN"   # NOTE: SGLang runs EAGLE on a DeepSeek-V3 / GLM-4.5 checkpoint as its own MTP layers
    if name in REFUSED_ALGORITHMS:
        raise ValueError(f"speculative_algorithm={algo!r}: {REFUSED_ALGORITHMS[name]}")
    if name not in SPECULATIVE_ALGORITHMS:
        raise ValueError(f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS} or None, got {algo!r}")
    check_range("speculative_num_draft_tokens", cfg.speculative_num_draft_tokens, 2, MAX_NUM_DRAFT_TOKENS,
                integer=True, or_none=True)
    check_range("speculative_num_steps", cfg.speculative_num_steps, 1, MAX_NUM_DRAFT_TOKENS - 1,
                integer=True, or_none=True)
    if cfg.speculative_eagle_topk not in (None, 1):
        raise ValueError(f"speculative_eagle_topk must be 1 (chain drafts; tree drafts are not supported), "
                         f"got {cfg.speculative_eagle_topk!r}")
    if (cfg.speculative_num_draft_tokens is not None and cfg.speculative_num_steps is not None
            and cfg.speculative_num_draft_tokens != cfg.speculative_num_steps + 1):
        raise ValueError(f"speculative_num_draft_tokens={cfg.speculative_num_draft_tokens} must be "
                         f"speculative_num_steps + 1 = {cfg.speculative_num_steps + 1} with chain drafts "
                         f"(speculative_eagle_topk 1); give one of the two")
    if name == "STANDALONE":
        if not isinstance(path, str) or not path:
            raise ValueError(f"speculative_algorithm='STANDALONE' needs speculative_draft_model_path (a draft "
                             f"checkpoint directory with the target's tokenizer), got {path!r}")
    elif name == "NEXTN":
        if path not in (None, cfg.model_path):
            raise ValueError(f"speculative_draft_model_path={path!r}: NEXTN reads the MTP layers of model_path's "
                             f"own checkpoint; leave it unset (a separate MTP checkpoint is not supported)")
    elif path is not None:
        raise ValueError(f"speculative_draft_model_path={path!r} is read only by speculative_algorithm "
                         f"'STANDALONE', got {algo!r}")
    lo, hi = cfg.speculative_ngram_min_match_window_size, cfg.speculative_ngram_max_match_window_size
    check_range("speculative_ngram_min_match_window_size", lo, 1, integer=True)
    check_range("speculative_ngram_max_match_window_size", hi, lo, integer=True)
    return name


def num_draft_tokens(cfg: Any) -> int:
    """Verified positions per request and step: 1 (the last token alone) when speculation is off,
    else speculative_num_draft_tokens (the drafts and the bonus token)."""
    if cfg.speculative_algorithm is None:
        return 1
    if cfg.speculative_num_draft_tokens is not None:
        return cfg.speculative_num_draft_tokens
    if cfg.speculative_num_steps is not None:
        return cfg.speculative_num_steps + 1
    return DEFAULT_NUM_DRAFT_TOKENS
