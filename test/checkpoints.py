"""Small checkpoint files the tests build (the test directory is on sys.path through its conftest)."""
from __future__ import annotations

import os


def write_tokenizer(path: str) -> None:
    """A small byte-level BPE tokenizer.json with the chat special tokens, as a checkpoint ships one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the robot picks up the red block and puts it in the bowl"] * 50, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
