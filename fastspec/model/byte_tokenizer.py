"""A byte-level tokenizer built in-process, so `tiny-random` models run the whole text path
(chat template, streaming, bench) in tests without any file or download.

ids 0..2 are <unk>, <s>, <|im_end|>; 3..258 are the 256 bytes; the rest of the vocab is unused.
"""
from __future__ import annotations

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>"]
    byte_tokens = [pre_tokenizers.ByteLevel.alphabet()]
    alphabet = sorted(byte_tokens[0])
    vocab = {tok: i for i, tok in enumerate(specials[:3])}
    for i, ch in enumerate(alphabet):
        vocab[ch] = 3 + i
    vocab["<|im_start|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast
