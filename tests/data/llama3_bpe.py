"""A small Llama-3-style byte-level BPE tokenizer.json, trained here on generated English and CJK text
with the `tokenizers` library (nothing is downloaded): Llama 3's split regex, byte-level alphabet,
<|begin_of_text|> added before every sequence by the post-processor, <|end_of_text|> as the eos."""

from __future__ import annotations

import random
from pathlib import Path

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
WORDS = ("the of and to in is was that for on with as by at from this which his her had were be not are "
         "Anne Elliot walked Uppercross Kellynch Hall morning letter captain sister garden evening").split()
CJK = "東京大阪日本語中文字学生先生時間今日明日天気雨雪山川海空花鳥風月愛心人生世界平和"


def english(rng: random.Random, words: int) -> str:
    out = []
    for i in range(words):
        w = rng.choice(WORDS)
        out.append(w.capitalize() if i % 12 == 0 else w)
        if i % 12 == 11:
            out[-1] += "."
    return " ".join(out)


def cjk(rng: random.Random, chars: int, newline_every: int = 0) -> str:
    s = "".join(rng.choice(CJK) if rng.random() > 0.05 else "。" for _ in range(chars))
    if newline_every:
        s = "\n".join(s[i : i + newline_every] for i in range(0, len(s), newline_every))
    return s


def build(path: Path, vocab_size: int = 1200) -> Path:
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors, trainers

    rng = random.Random(0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = __import__("tokenizers").decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([english(rng, 200) for _ in range(50)] + [cjk(rng, 400, 50) for _ in range(50)],
                            trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path
