"""carry's byte-level BPE against Hugging Face's `tokenizers`, id for id, on tokenizer.json files built here
(no download): trained with `tokenizers` on a small mixed-script text, in three styles: GPT-2 (ByteLevel
with its regex), Llama 3 (Split with the cl100k regex, then ByteLevel) and Qwen2 (NFC, Split with Qwen2's
regex, then ByteLevel). carry tokenizes with `carry tokenize --tokenizer bpe:FILE` (one document a file);
the test reads its token file and compares each document with `tokenizers`' ids. Needs --carry-binary and
`tokenizers`; the Qwen2 style needs a carry built with Oniguruma and utf8proc (launcher/setup installs them)."""
import os
import struct
import subprocess

import pytest

GPT2 = None  # ByteLevel's own regex
CL100K = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
         r"\s*[\r\n]+|\s+(?!\S)|\s+")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12345 o'clock, isn't it?",
    "Caf\u00e9 cr\u00e8me, na\u00efve fa\u00e7ade \u2014 \u00fcber Stra\u00dfe 2024!",
    "Cafe\u0301 decomposed, re\u0301sume\u0301; \ufb01ne ligatures and \u2460 circled digits.",
    "\u4e2d\u6587\u5206\u8bcd\u6d4b\u8bd5\uff0c\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002",
    "Emoji \U0001f600\U0001f680 and tabs\t\tand   spaces\n\n\nnew lines\r\n  indented code: x = y[3] + 4",
    "def f(x):\n    return x ** 2  # comment\n\n\nclass A:  pass\n",
]


def _tokenizer(style, pattern):
    tk = pytest.importorskip("tokenizers")
    from tokenizers import Regex, models, normalizers, pre_tokenizers, decoders, trainers
    tok = tk.Tokenizer(models.BPE())
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


def _read_tokens(path):
    data = open(path, "rb").read()
    assert data[:8] == b"CARRYTOK"
    width, count = struct.unpack_from("<IQ", data, 12)
    fmt = {2: "H", 4: "I"}[width]
    return list(struct.unpack_from("<%d%s" % (count, fmt), data, 24))


@pytest.mark.parametrize("style,pattern", [("gpt2", GPT2), ("llama3", CL100K), ("qwen2", QWEN2)])
def test_carry_bpe_matches_hugging_face(carry_binary, tmp_path, style, pattern):
    tok = _tokenizer(style, pattern)
    path = tmp_path / f"{style}.json"
    tok.save(str(path))
    texts = CORPUS + ["Unseen words: Zyzzyva, \u00c5ngstr\u00f6m, \u0627\u0644\u0639\u0631\u0628\u064a\u0629 "
                      "\u0661\u0662\u0663, e\u0301\u0301 and 9876543210."]
    inputs = []
    for i, t in enumerate(texts):
        f = tmp_path / f"doc{i}.txt"
        f.write_bytes(t.encode("utf-8"))
        inputs.append(str(f))
    out = tmp_path / "out.tok"
    r = subprocess.run([carry_binary, "tokenize", "--input", *inputs, "--output", str(out), "--tokenizer",
                        f"bpe:{path}", "--threads", "1"], capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode != 0 and "needs Oniguruma" in r.stderr + r.stdout:
        pytest.skip("this carry was built without Oniguruma and utf8proc")
    assert r.returncode == 0, r.stderr
    ids = _read_tokens(out)
    eod = tok.token_to_id("<|endoftext|>")
    docs, cur = [], None
    for t in ids:
        if t == eod:
            cur = []
            docs.append(cur)
        else:
            cur.append(t)
    assert len(docs) == len(texts)
    for text, got in zip(texts, docs):
        assert got == tok.encode(text).ids, text
