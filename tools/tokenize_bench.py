#!/usr/bin/env python3
"""tools/tokenize_bench.py --carry build/bin/carry [--bytes 1e9] [--threads N] [--work DIR] [--style gpt2|qwen2]

Times `carry tokenize --jsonl` against Hugging Face `tokenizers`' batch encoding on the same JSONL file and
prints one table. The corpus is what a fresh Debian machine holds: the text under /usr/share/doc (copyright
files and the gzipped changelogs and READMEs) and the Python standard library's sources, one document a
file, written as JSONL lines ({"text": ...}) and repeated until the file has --bytes bytes. The tokenizer is
a 32,000-token byte-level BPE that `tokenizers` trains on the first 20 MB of it, in GPT-2's style (its
ByteLevel regex: carry's hand-written scanner) or Qwen2's (NFC and a Split regex: Oniguruma and utf8proc).
Both sides use --threads threads (default: every core): carry with --threads, `tokenizers` through
RAYON_NUM_THREADS, encoding batches of 4,096 documents already read and parsed (carry's time includes
reading and parsing the file); before timing, both tokenize the first 2,000
documents and their ids must agree. Needs the `tokenizers` package (launcher/python_env installs it).
"""
import argparse
import glob
import gzip
import json
import os
import subprocess
import sys
import time

QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
         r"\s*[\r\n]+|\s+(?!\S)|\s+")


def documents():
    for path in sorted(glob.glob("/usr/share/doc/**/*", recursive=True)):
        if not os.path.isfile(path) or os.path.islink(path):
            continue
        try:
            if path.endswith(".gz"):
                with gzip.open(path, "rb") as f:
                    data = f.read(1 << 22)
            elif os.path.basename(path) in ("copyright",) or path.endswith((".txt", ".md")):
                with open(path, "rb") as f:
                    data = f.read(1 << 22)
            else:
                continue
        except OSError:
            continue
        text = data.decode("utf-8", "ignore")
        if text.strip():
            yield text
    lib = os.path.dirname(os.__file__)
    for path in sorted(glob.glob(os.path.join(lib, "**", "*.py"), recursive=True)):
        try:
            with open(path, "rb") as f:
                text = f.read(1 << 22).decode("utf-8", "ignore")
        except OSError:
            continue
        if text.strip():
            yield text


def write_corpus(path, target):
    docs = list(documents())
    if not docs:
        sys.exit("tokenize_bench: no text found under /usr/share/doc or the Python library")
    written, n = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            for d in docs:
                line = json.dumps({"text": d}, ensure_ascii=False) + "\n"
                f.write(line)
                written += len(line.encode("utf-8"))
                n += 1
                if written >= target:
                    break
    return written, n, sum(len(d.encode("utf-8")) for d in docs)


def train_tokenizer(corpus, out, style):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def sample():
        seen = 0
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                t = json.loads(line)["text"]
                seen += len(t)
                yield t
                if seen > 20 << 20:
                    return
    tok.train_from_iterator(sample(), trainer)
    tok.save(out)
    return tok


def read_tokens(path):
    import struct
    with open(path, "rb") as f:
        head = f.read(24)
        width, count = struct.unpack_from("<IQ", head, 12)
        data = f.read()
    import array
    a = array.array("H" if width == 2 else "I")
    a.frombytes(data[:count * width])
    return a


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--carry", required=True, help="the carry program (build/bin/carry)")
    ap.add_argument("--bytes", type=float, default=1e9, help="size of the JSONL file (default 1e9)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--work", default="tokenize_bench", help="folder for the corpus, tokenizer and outputs")
    ap.add_argument("--style", choices=["gpt2", "qwen2"], default="gpt2")
    a = ap.parse_args()
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        sys.exit("tokenize_bench: needs the tokenizers package (pip install tokenizers)")
    os.makedirs(a.work, exist_ok=True)
    corpus = os.path.join(a.work, "corpus.jsonl")
    target = int(a.bytes)
    if not os.path.exists(corpus) or os.path.getsize(corpus) < target:
        size, n, distinct = write_corpus(corpus, target)
        print(f"corpus: {corpus}, {size / 1e9:.3f} GB, {n} documents ({distinct / 1e6:.1f} MB of distinct text)",
              flush=True)
    size = os.path.getsize(corpus)
    tok_path = os.path.join(a.work, f"tokenizer_{a.style}.json")
    tok = train_tokenizer(corpus, tok_path, a.style)
    eod = tok.token_to_id("<|endoftext|>")

    # Agreement on the first 2,000 documents.
    head = os.path.join(a.work, "head.jsonl")
    with open(corpus, encoding="utf-8") as f, open(head, "w", encoding="utf-8") as g:
        texts = []
        for line in f:
            g.write(line)
            texts.append(json.loads(line)["text"])
            if len(texts) == 2000:
                break
    subprocess.run([a.carry, "tokenize", "--jsonl", head, "--output", os.path.join(a.work, "head.tok"),
                    "--tokenizer", f"bpe:{tok_path}", "--threads", str(a.threads)], check=True, capture_output=True)
    want = []
    for e in tok.encode_batch(texts):
        want.append(eod)
        want.extend(e.ids)
    got = list(read_tokens(os.path.join(a.work, "head.tok")))
    if got != want:
        first = next(i for i, (x, y) in enumerate(zip(got, want)) if x != y) if len(got) == len(want) else -1
        sys.exit(f"tokenize_bench: carry and tokenizers disagree on the first {len(texts)} documents "
                 f"({len(got)} vs {len(want)} ids, first difference at {first})")

    t0 = time.perf_counter()
    subprocess.run([a.carry, "tokenize", "--jsonl", corpus, "--output", os.path.join(a.work, "all.tok"),
                    "--tokenizer", f"bpe:{tok_path}", "--threads", str(a.threads)], check=True, capture_output=True)
    carry_s = time.perf_counter() - t0
    carry_tokens = len(read_tokens(os.path.join(a.work, "all.tok")))

    env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads))
    code = f"""
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file({tok_path!r})
with open({corpus!r}, encoding="utf-8") as f:
    texts = [json.loads(line)["text"] for line in f]
n = 0
t0 = time.perf_counter()
for i in range(0, len(texts), 4096):
    n += sum(len(e.ids) + 1 for e in tok.encode_batch(texts[i:i + 4096]))
print(time.perf_counter() - t0, n)
"""
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout.split()
    hf_s, hf_tokens = float(out[0]), int(out[1])
    print(f"\n{size / 1e9:.3f} GB of JSONL, {a.style} style, {a.threads} threads, ids agree on the first "
          f"{len(texts)} documents")
    print(f"{'tokenizer':<34}{'seconds':>10}{'MB/s':>10}{'tokens':>14}")
    print(f"{'carry tokenize --jsonl':<34}{carry_s:>10.1f}{size / 1e6 / carry_s:>10.1f}{carry_tokens:>14}")
    print(f"{'tokenizers encode_batch':<34}{hf_s:>10.1f}{size / 1e6 / hf_s:>10.1f}{hf_tokens:>14}")
    print(f"carry / tokenizers: {hf_s / carry_s:.2f}x the speed")


if __name__ == "__main__":
    main()
