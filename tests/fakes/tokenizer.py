"""A tiny byte-level BPE tokenizer folder, trained in milliseconds, shaped like the demo model's
(byte-level pre-tokenizer without a prefix space, BOS prepended)."""

from __future__ import annotations

from pathlib import Path

WORDS = [
    *("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "omega"),
    *("cache", "prefix", "router", "token", "block", "radix", "tree", "node", "worker"),
    *("request", "latency", "throughput", "model", "serve", "batch", "queue", "stream"),
]


def tiny_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12)) for i in range(200)]
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder
