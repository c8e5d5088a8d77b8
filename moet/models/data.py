"""Corpus and tokenizer of the embedded default model: the running interpreter's standard library.

Every machine with Python has this text, so the model and its held-out score can be rebuilt
anywhere. The file list is sorted and the held-out split is by file (every `HELDOUT_EVERY`-th), so
no held-out line was ever seen in training.

    python -m moet.models.data --out .cache/default_model

writes tokenizer.json, tokenizer_config.json, train.npy / heldout.npy (uint16 token ids, files
joined by <|endoftext|>) and corpus.json (file lists, byte and token counts, a hash of the text).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

VOCAB_SIZE = 4096
HELDOUT_EVERY = 20
EOS = "<|endoftext|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = (EOS, *(f"<|{role}|>" for role in ROLES))
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's .py files in sorted order (third-party site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(train, held-out): every HELDOUT_EVERY-th file (index % 20 == 19) is held out."""
    train = [f for i, f in enumerate(files) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    heldout = [f for i, f in enumerate(files) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return train, heldout


def read_text(path: Path) -> str:
    """A source file as text; the few non-UTF-8 test fixtures decode with replacement characters."""
    return path.read_bytes().decode("utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE (GPT-2 style pre-tokenizer) with the special tokens at ids 0..3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json: PreTrainedTokenizerFast, so transformers and vLLM load it offline."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok, out: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    """Token ids of the texts joined by <|endoftext|> (one before each file), as uint16."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(eos)
        ids.extend(enc.ids)
    return np.asarray(ids, dtype=np.uint16)


def prepare(out: Path, root: Path | None = None) -> dict:
    """Build the tokenizer and the token files under `out`; return the corpus summary."""
    files = stdlib_files(root)
    train, heldout = split_files(files)
    base = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    train_texts = [read_text(f) for f in train]
    heldout_texts = [read_text(f) for f in heldout]
    tok = train_tokenizer(train_texts)
    save_tokenizer(tok, out)
    train_ids = encode_stream(tok, train_texts)
    heldout_ids = encode_stream(tok, heldout_texts)
    np.save(out / "train.npy", train_ids)
    np.save(out / "heldout.npy", heldout_ids)
    digest = hashlib.sha256()
    for f, text in zip(train + heldout, train_texts + heldout_texts):
        digest.update(str(f.relative_to(base)).encode() + b"\0" + text.encode())
    summary = {
        "source": f"Python {sys.version.split()[0]} standard library at {base}",
        "files": {"train": len(train), "heldout": len(heldout)},
        "bytes": {"train": sum(len(t.encode()) for t in train_texts), "heldout": sum(len(t.encode()) for t in heldout_texts)},
        "tokens": {"train": int(train_ids.size), "heldout": int(heldout_ids.size)},
        "split": f"file index % {HELDOUT_EVERY} == {HELDOUT_EVERY - 1} is held out",
        "sha256": digest.hexdigest(),
        "heldout_files": [str(f.relative_to(base)) for f in heldout],
    }
    (out / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".cache/default_model"))
    parser.add_argument("--stdlib", type=Path, default=None, help="library root (default: this interpreter's)")
    args = parser.parse_args(argv)
    summary = prepare(args.out, args.stdlib)
    print(json.dumps({k: v for k, v in summary.items() if k != "heldout_files"}, indent=2))


if __name__ == "__main__":
    main()
