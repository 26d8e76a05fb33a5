#!/usr/bin/env python
"""Build the embedded default model ``configs/tiny-moe``: a tiny Qwen3-MoE causal LM,
seeded-initialised and then pre-trained (supervised, ``trainer_bridge.pretrain``) on the embedded
arithmetic task (``trainer_bridge.task``) plus a share of plain sentences, so that it is neither
random nor perfect on the task (57% of 256 held-out questions right, greedy): the starting
point of the GRPO example (``configs/train/tiny.yaml``). Plus a locally trained byte-level BPE
tokenizer.

Everything is generated locally and deterministically from ``--seed`` (single-threaded,
deterministic torch algorithms); nothing is downloaded.  Running the script twice yields
byte-identical files. Pre-training takes a few minutes on one CPU core.

    python scripts/make_tiny_moe.py [--out configs/tiny-moe] [--seed 0] [--pretrain-steps 750] [--no-check]

Reusable pieces (imported by other scripts, e.g. a later arithmetic task):
    generate_corpus(seed, ...)     -> list[str]   the tokenizer training text
    make_arith_example(rng, ...)   -> (question, answer) strings
    build_tokenizer(seed)          -> tokenizers.Tokenizer
    build_model(vocab_size, ...)   -> Qwen3MoeForCausalLM
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
from pathlib import Path

# Offline, single-threaded, quiet: makes tokenizer training reproducible and
# guarantees nothing is fetched from the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]  # ids 0, 1, 2

# The word lists saturate BPE at ~590 tokens; 576 = 9*64 so the tokenizer size equals the
# model vocab exactly (no untokenizable padding ids the model could sample).
TOKENIZER_VOCAB_TARGET = 576
MAX_POSITIONS = 2048

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MODEL_CONFIG = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=16,
    num_experts_per_tok=4,
    # 32 (not 64) keeps fp32 safetensors < 6 MB with 16 experts x 4 layers.
    moe_intermediate_size=32,
    intermediate_size=256,  # only used by dense layers (mlp_only_layers); none here
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    hidden_act="silu",
    max_position_embeddings=MAX_POSITIONS,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    tie_word_embeddings=False,
    attention_bias=False,
    use_sliding_window=False,
    attention_dropout=0.0,
    output_router_logits=False,
    router_aux_loss_coef=0.001,
    use_cache=True,
)

# --------------------------------------------------------------------------
# Text generation (reusable)
# --------------------------------------------------------------------------

NOUNS = [
    "cat", "dog", "bird", "fish", "tree", "house", "car", "book", "river", "sun",
    "moon", "star", "road", "city", "child", "man", "woman", "teacher", "farmer",
    "ship", "apple", "stone", "cloud", "garden", "door", "window", "horse", "king",
    "queen", "robot", "number", "answer", "question", "model", "expert", "token",
]
ADJECTIVES = [
    "big", "small", "red", "blue", "green", "old", "new", "happy", "sad", "quick",
    "slow", "bright", "dark", "quiet", "loud", "warm", "cold", "tall", "short", "good",
]
VERBS = [
    "sees", "likes", "finds", "makes", "takes", "gives", "helps", "reads", "builds",
    "moves", "counts", "knows", "wants", "calls", "follows", "opens", "writes", "adds",
]
INTRANSITIVE = ["runs", "sleeps", "sings", "waits", "walks", "jumps", "smiles", "thinks"]
ADVERBS = ["slowly", "quickly", "today", "again", "often", "never", "here", "there", "well"]
DETERMINERS = ["the", "a", "one", "every", "this", "that", "my", "your"]
PREPOSITIONS = ["in", "on", "near", "under", "over", "with", "by", "from"]
CONNECTIVES = ["and", "but", "so", "then", "because"]


def make_arith_example(rng: random.Random, max_operand: int = 99, ops: str = "+-*") -> tuple[str, str]:
    """Return ("Q: 37+45=", "82") style question/answer strings."""
    op = rng.choice(ops)
    a = rng.randint(0, max_operand)
    b = rng.randint(0, max_operand)
    if op == "-" and b > a:
        a, b = b, a
    if op == "*":
        b = rng.randint(0, 12)
    ans = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"Q: {a}{op}{b}=", str(ans)


def _noun_phrase(rng: random.Random) -> str:
    parts = [rng.choice(DETERMINERS)]
    if rng.random() < 0.5:
        parts.append(rng.choice(ADJECTIVES))
    parts.append(rng.choice(NOUNS))
    return " ".join(parts)


def make_sentence(rng: random.Random) -> str:
    """A short English-like sentence from the small word lists."""
    subj = _noun_phrase(rng)
    if rng.random() < 0.6:
        clause = f"{subj} {rng.choice(VERBS)} {_noun_phrase(rng)}"
    else:
        clause = f"{subj} {rng.choice(INTRANSITIVE)}"
    if rng.random() < 0.4:
        clause += f" {rng.choice(PREPOSITIONS)} {_noun_phrase(rng)}"
    if rng.random() < 0.3:
        clause += f" {rng.choice(ADVERBS)}"
    if rng.random() < 0.25:
        clause += f" {rng.choice(CONNECTIVES)} {_noun_phrase(rng)} {rng.choice(INTRANSITIVE)}"
    end = rng.choice([".", ".", ".", "!", "?"])
    return clause[0].upper() + clause[1:] + end


def make_digits(rng: random.Random) -> str:
    n = rng.randint(1, 12)
    return " ".join(str(rng.randint(0, 10 ** rng.randint(1, 4) - 1)) for _ in range(n))


def generate_corpus(seed: int = 0, n_arith: int = 6000, n_sentences: int = 6000, n_digits: int = 1000,
                    chat_fraction: float = 0.1) -> list[str]:
    """Deterministic mixed training text: arithmetic Q/A lines, sentences, digit runs.

    A fraction of arithmetic lines are wrapped in the chat format
    (<|im_start|>user ... <|im_end|>) so that chat-formatted text is in-distribution.
    """
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(n_arith):
        q, a = make_arith_example(rng)
        if rng.random() < chat_fraction:
            lines.append(f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\nA: {a}{IM_END}\n")
        else:
            lines.append(f"{q} A: {a}{EOS_TOKEN}")
    for _ in range(n_sentences):
        k = rng.randint(1, 3)
        lines.append(" ".join(make_sentence(rng) for _ in range(k)))
    for _ in range(n_digits):
        lines.append(make_digits(rng))
    rng.shuffle(lines)
    return lines


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------

def build_tokenizer(seed: int = 0, vocab_size: int = TOKENIZER_VOCAB_TARGET):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # Split digits individually (like Qwen) before byte-level splitting: better for arithmetic.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(generate_corpus(seed), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def save_tokenizer(tok, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=MAX_POSITIONS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    # save_jinja_files=False keeps chat_template inside tokenizer_config.json.
    hf_tok.save_pretrained(str(out), save_jinja_files=False)
    # "PreTrainedTokenizerFast" loads in transformers 4.x and 5.x (5.x default is "TokenizersBackend").
    _canonicalize_json(out / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"})


def _canonicalize_json(path: Path, update: dict | None = None, rename: dict | None = None) -> None:
    """Rewrite a small json file with sorted keys so it is byte-stable."""
    if path.exists():
        data = json.loads(path.read_text(encoding="utf-8"))
        for old, new in (rename or {}).items():
            if old in data:
                data[new] = data.pop(old)
        data.update(update or {})
        path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------

def build_model(vocab_size: int, eos_id: int, seed: int = 0):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=vocab_size,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
        **MODEL_CONFIG,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32).eval()
    return model


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pretrain_model(model, tok, seed: int, steps: int) -> float:
    """Supervised pre-training on the arithmetic task; returns the held-out greedy accuracy."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from trainer_bridge.pretrain import PretrainConfig, greedy_accuracy, pretrain
    from trainer_bridge.task import ArithmeticTask

    eos_id = tok.token_to_id(EOS_TOKEN)
    encode = lambda text: tok.encode(text).ids  # noqa: E731
    decode = lambda ids: tok.decode(ids)  # noqa: E731
    task = ArithmeticTask()
    rng = random.Random(seed + 1)
    sentences = [make_sentence(rng) for _ in range(2000)]
    cfg = PretrainConfig(steps=steps, schedule_steps=max(steps, 1500), seed=seed, log_every=max(1, steps // 5))
    pretrain(model, encode, eos_id, config=cfg, task=task, sentences=sentences)
    held_out = task.examples(256, seed=seed + 1, split="eval", unique=True)
    acc = greedy_accuracy(model, encode, decode, held_out, eos_id=eos_id)
    print(f"held-out arithmetic accuracy after {steps} pre-training steps (greedy, {len(held_out)} questions): "
          f"{acc:.3f}")
    return acc


def build(out: Path, seed: int, pretrain_steps: int = 750) -> None:
    import torch
    from transformers import GenerationConfig

    torch.use_deterministic_algorithms(True)
    # NOTE: one thread: CPU kernels may split reductions by thread count, and the pre-trained
    # weights must not depend on the machine.
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json", "chat_template.jinja"):
        (out / name).unlink(missing_ok=True)

    tok = build_tokenizer(seed)
    tok_size = tok.get_vocab_size(with_added_tokens=True)
    vocab_size = (tok_size + 63) // 64 * 64
    if vocab_size != tok_size:
        print(f"warning: tokenizer size {tok_size} padded to model vocab {vocab_size}", file=sys.stderr)
    eos_id = tok.token_to_id(EOS_TOKEN)
    save_tokenizer(tok, out)

    model = build_model(vocab_size, eos_id, seed)
    if pretrain_steps > 0:
        pretrain_model(model, tok, seed, pretrain_steps)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        do_sample=False, max_new_tokens=64,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    # Match the key spelling of real Qwen3-MoE checkpoints (transformers 5 writes the internal
    # alias "num_local_experts"; it maps "num_experts" back on load) and also expose the legacy
    # top-level rope_theta for loaders that do not read rope_parameters.
    _canonicalize_json(out / "config.json", {"rope_theta": MODEL_CONFIG["rope_parameters"]["rope_theta"]},
                       rename={"num_local_experts": "num_experts"})
    _canonicalize_json(out / "generation_config.json")

    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer vocab: {tok_size} (model vocab_size {vocab_size}), eos/pad/bos id: {eos_id}")
    print(f"params: {n_params:,} ({n_params * 4 / 2**20:.2f} MiB fp32)")


def summarize(out: Path) -> None:
    total = 0
    print(f"files in {out}:")
    for p in sorted(out.iterdir()):
        if p.is_file():
            total += p.stat().st_size
            print(f"  {p.name:24s} {p.stat().st_size:>10,d}  sha256={_sha256(p)}")
    print(f"  total {total:,} bytes ({total / 2**20:.2f} MiB)")


def check(out: Path) -> None:
    import torch
    from safetensors import safe_open
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32).eval()

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = sorted(f.keys())
    layer0 = [k for k in keys if k.startswith("model.layers.0.")]
    print(f"safetensors: {len(keys)} tensors; layer 0 keys (experts 0..15 elided to 0):")
    for k in layer0:
        if ".experts." in k and not ".experts.0." in k:
            continue
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            print(f"  {k} {tuple(f.get_slice(k).get_shape())}")

    prompt = "Q: 37+45= A:"
    ids_raw = raw.encode(prompt).ids
    enc = tok(prompt, return_tensors="pt")
    assert enc.input_ids[0].tolist() == ids_raw, "tokenizers vs transformers encode mismatch"
    assert raw.decode(ids_raw) == prompt
    print(f"prompt {prompt!r} -> {ids_raw} tokens {raw.encode(prompt).tokens}")

    torch.manual_seed(0)
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=16, do_sample=False)
        logits = model(**enc).logits
    print(f"greedy: {tok.decode(gen[0], skip_special_tokens=False)!r}")
    p = torch.softmax(logits[0, -1], -1)
    print(f"last-token entropy {-(p * p.clamp_min(1e-12).log()).sum():.3f} nats (uniform {torch.log(torch.tensor(float(p.numel()))):.3f})")

    # Routing sanity: experts used across a batch in layer 0.
    with torch.no_grad():
        outr = model(**tok(["The big cat sees a dog.", "Q: 12*7= A: 84"], return_tensors="pt", padding=True),
                     output_router_logits=True)
    used = [int(torch.topk(r, 4, -1).indices.unique().numel()) for r in outr.router_logits]
    print(f"distinct experts selected per layer (of 16): {used}")

    chat = tok.apply_chat_template([{"role": "user", "content": "Q: 2+3="}], tokenize=False, add_generation_prompt=True)
    print(f"chat template: {chat!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "configs" / "tiny-moe"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pretrain-steps", type=int, default=750,
                    help="supervised pre-training steps on the arithmetic task (0: random weights)")
    ap.add_argument("--no-check", action="store_true", help="skip reload/generate verification")
    ap.add_argument("--check-only", action="store_true", help="only verify an existing output dir")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if not args.check_only:
        build(out, args.seed, args.pretrain_steps)
    summarize(out)
    if not args.no_check:
        check(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
