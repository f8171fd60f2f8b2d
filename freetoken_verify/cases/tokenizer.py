"""A small byte-level BPE tokenizer for the bundled cases, trained deterministically on a fixed
corpus so `make golden` writes the same bytes every time."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog " * 3,
    "tensor parallel inference splits every weight across ranks",
    "hello world, freetoken verifies logits at every position",
] * 5
EOS = "<|endoftext|>"
TOKENIZER_VOCAB = 300


def write_tokenizer(folder: Path) -> int:
    """Train and save the tokenizer into `folder`; returns the end-of-text token id."""
    # tokenizers / transformers cost seconds to import; only writing a case needs them.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.save_pretrained(folder)
    return tok.token_to_id(EOS)
