#!/usr/bin/env python
"""Regenerate titan-megamoe's bundled tiny corpus and BPE tokenizer (titan_megamoe/assets/).

The corpus is our own: English-like prose produced from the word lists and sentence templates in
this file by a seeded random generator, so it is deterministic, license-free and needs no download.
The tokenizer is a byte-level BPE trained on that corpus with the `tokenizers` library and saved in
the layout TorchTitan 0.2.2's HuggingFaceTokenizer loads from `model.hf_assets_path`
(tokenizer.json + tokenizer_config.json naming the bos/eos tokens).

    python scripts/make_tiny_assets.py [--out titan_megamoe/assets] [--kib 420] [--vocab 2048]

Output: corpus/tiny_corpus.jsonl ({"text": ...} per document) and tokenizer/{tokenizer.json,
tokenizer_config.json}. The vocabulary size is 2048 so the ids also fit TorchTitan's Qwen3
`debugmodel`/`debugmodel_moe` flavors (vocab_size=2048).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
SEED = 20261202

NAMES = ["Ada", "Bram", "Cora", "Dmitri", "Elin", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kiri",
         "Lena", "Marek", "Nadia", "Oskar", "Priya", "Quinn", "Rosa", "Soren", "Talia", "Ugo", "Vera",
         "Wim", "Xenia", "Yusuf", "Zora"]
PLACES = ["the harbor", "the old mill", "the northern ridge", "the market square", "the river bend",
          "the library", "the lighthouse", "the orchard", "the railway yard", "the quarry", "the valley",
          "the workshop", "the observatory", "the salt flats", "the bridge", "the bakery"]
NOUNS = ["lantern", "engine", "map", "letter", "garden", "machine", "boat", "clock", "ledger", "storm",
         "kettle", "signal", "bicycle", "window", "compass", "violin", "harvest", "tunnel", "basket",
         "telescope", "notebook", "wagon", "mirror", "bell", "anchor", "furnace", "loom", "pump",
         "ladder", "cart", "radio", "field", "forest", "road", "tower", "gate", "well", "roof", "fence"]
ADJS = ["quiet", "rusty", "bright", "narrow", "heavy", "careful", "ancient", "restless", "patient",
        "crooked", "silver", "hollow", "steady", "bitter", "gentle", "curious", "distant", "wooden",
        "broken", "clever", "tired", "warm", "cold", "small", "large", "strange", "simple", "green"]
VERBS_PAST = ["repaired", "carried", "found", "opened", "painted", "measured", "counted", "followed",
              "built", "cleaned", "lost", "sold", "borrowed", "studied", "watched", "tested", "moved",
              "weighed", "sketched", "loaded", "checked", "mended", "described", "traded", "lifted"]
VERBS_INF = ["repair", "carry", "find", "open", "paint", "measure", "count", "follow", "build", "clean",
             "sell", "borrow", "study", "watch", "test", "move", "weigh", "sketch", "load", "check"]
ADVS = ["slowly", "quickly", "carefully", "quietly", "eagerly", "twice", "again", "at last", "together",
        "alone", "before dawn", "after supper", "in the rain", "without a word", "by lamplight"]
TIMES = ["In the morning", "That winter", "On the third day", "Before the fair", "After the flood",
         "Late in the evening", "Every spring", "Once a year", "At noon", "During the long summer"]
CONNECT = ["because", "although", "while", "so that", "until", "after", "before", "since"]
TOPICS = ["trade", "weather", "machines", "music", "farming", "travel", "numbers", "the sea", "stars",
          "bread", "rivers", "tools", "old stories", "letters", "clocks"]


def _np(r: random.Random) -> str:
    """A noun phrase: determiner, optional adjective, noun."""
    det = r.choice(["the", "a", "her", "his", "their", "an old", "one"])
    adj = r.choice(ADJS) + " " if r.random() < 0.6 else ""
    return f"{det} {adj}{r.choice(NOUNS)}"


def _sentence(r: random.Random) -> str:
    n = r.choice(NAMES)
    forms = [
        lambda: f"{n} {r.choice(VERBS_PAST)} {_np(r)} {r.choice(ADVS)}.",
        lambda: f"{r.choice(TIMES)}, {n} {r.choice(VERBS_PAST)} {_np(r)} near {r.choice(PLACES)}.",
        lambda: f"{n} wanted to {r.choice(VERBS_INF)} {_np(r)} {r.choice(CONNECT)} "
                f"{r.choice(NAMES)} had {r.choice(VERBS_PAST)} {_np(r)}.",
        lambda: f"The {r.choice(ADJS)} {r.choice(NOUNS)} at {r.choice(PLACES)} was {r.choice(ADJS)} "
                f"and {r.choice(ADJS)}.",
        lambda: f"\"Did you {r.choice(VERBS_INF)} {_np(r)}?\" asked {n}.",
        lambda: f"\"We will {r.choice(VERBS_INF)} it {r.choice(ADVS)},\" said {n}.",
        lambda: f"There were {r.randint(2, 90)} {r.choice(NOUNS)}s and {r.randint(2, 40)} "
                f"{r.choice(NOUNS)}s in {r.choice(PLACES)}.",
        lambda: f"{n} wrote that {r.choice(TOPICS)} mattered more than {r.choice(TOPICS)}.",
        lambda: f"It took {r.randint(2, 12)} hours to {r.choice(VERBS_INF)} {_np(r)}, "
                f"{r.choice(CONNECT)} the {r.choice(NOUNS)} was {r.choice(ADJS)}.",
        lambda: f"Nobody at {r.choice(PLACES)} knew why {n} kept {_np(r)}.",
    ]
    return r.choice(forms)()


def _document(r: random.Random) -> str:
    title = f"{r.choice(ADJS).capitalize()} {r.choice(NOUNS)}s of {r.choice(PLACES)[4:].title()}"
    paragraphs = []
    for _ in range(r.randint(2, 5)):
        paragraphs.append(" ".join(_sentence(r) for _ in range(r.randint(3, 8))))
    return title + "\n\n" + "\n\n".join(paragraphs)


def make_corpus(kib: int, seed: int = SEED) -> list[str]:
    r = random.Random(seed)
    docs, size = [], 0
    while size < kib * 1024:
        doc = _document(r)
        docs.append(doc)
        size += len(doc.encode()) + 12
    return docs


def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "titan_megamoe" / "assets"))
    ap.add_argument("--kib", type=int, default=420, help="corpus size in KiB")
    ap.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary size (special tokens included)")
    args = ap.parse_args(argv)

    out = Path(args.out)
    (out / "corpus").mkdir(parents=True, exist_ok=True)
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)

    docs = make_corpus(args.kib)
    with open(out / "corpus" / "tiny_corpus.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")

    tok = train_tokenizer(docs, args.vocab)
    tok.save(str(out / "tokenizer" / "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": True,
        "model_max_length": 1 << 20,
    }
    with open(out / "tokenizer" / "tokenizer_config.json", "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")

    n_tokens = sum(len(e.ids) for e in tok.encode_batch(docs))
    print(f"wrote {len(docs)} documents ({sum(map(len, docs)) / 1024:.0f} KiB, {n_tokens:,} tokens) and a "
          f"{tok.get_vocab_size()}-token BPE tokenizer to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
