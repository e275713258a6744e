"""`carry export --tokenizer sentencepiece:M.model` writes a tokenizer.json that encodes as SentencePiece does:
SentencePiece models trained here by `carry tokenize --train-sentencepiece` (unigram and BPE; the default
nmt_nfkc normalizer and identity; with and without the dummy prefix, extra-whitespace removal, byte
fallback and user-defined symbols) tokenize texts with `carry tokenize` (libsentencepiece), and Hugging
Face's `tokenizers` and transformers' AutoTokenizer, reading the exported folder alone, must give the same
ids for every text (mixed scripts, characters the model never saw, runs of spaces, tabs and newlines,
ligatures and full-width forms that NFKC rewrites). The folder also holds the model as tokenizer.model and
names its </s> as the end of document. Needs --carry-binary, a carry with SentencePiece, `tokenizers` and
`transformers` (launcher/python_env installs them)."""
import json
import os
import subprocess

import pytest

from hf_tokenizer_parity_test import _read_tokens

RUN = """name: "hf_sp_export"
seed: 1
model { vocab_size: 1024 d_model: 32 n_layers: 1 n_heads: 2 head_dim_k: 16 head_dim_v: 16
        mixers: "gated_deltanet" mixer_options { chunk_size: 16 conv_size: 4 } }
data { mqar { num_kv_pairs: 4 num_queries: 4 vocab_size: 300 } seq_len: 64 batch_size: 1 }
optimizer { lr: 1e-3 warmup_steps: 1 total_steps: 1 }
checkpoint { dir: "ck" every_steps: 1 }
"""

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12345 o'clock, isn't it?",
    "Caf\u00e9 cr\u00e8me, na\u00efve fa\u00e7ade \u2014 \u00fcber Stra\u00dfe 2024! Les enfants jouent dans le jardin.",
    "\u4e2d\u6587\u5206\u8bcd\u6d4b\u8bd5\uff0c\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002\u6771\u4eac\u3068\u5927\u962a",
    "def f(x):    return x ** 2  # a comment about the function and its return value",
    "Recurrent states pass between ranks by a prefix scan; the sequence is split across GPUs.",
    "Der schnelle braune Fuchs springt \u00fcber den faulen Hund, und die Katze schl\u00e4ft.",
]

TEXTS = CORPUS + [
    "  leading and trailing spaces,   runs   of spaces  ",
    "tabs\t\tand\nnew lines\n\n\nand \r\n carriage returns",
    "NFKC: \ufb01ne \ufb02ow, \u2460\u2461\u2462, \uff26\uff55\uff4c\uff4c\uff57\uff49\uff44\uff54\uff48, \u2163 and \u00bd",
    "Unseen: Zyzzyva \u00c5ngstr\u00f6m \u0627\u0644\u0639\u0631\u0628\u064a\u0629 \U0001f600\U0001f680 \u0e44\u0e17\u0e22",
    "user symbols<sep>inside[MASK]words and <sep> alone",
    "\u2581already escaped \u2581\u2581 markers",
    "x",
]

MODELS = {
    "unigram": ("unigram", []),
    "bpe": ("bpe", []),
    "unigram_bytes_symbols": ("unigram", ["byte_fallback=true", "user_defined_symbols=<sep>,[MASK]"]),
    "bpe_identity_bytes": ("bpe", ["byte_fallback=true", "normalization_rule_name=identity",
                                   "add_dummy_prefix=false", "remove_extra_whitespaces=false"]),
    "bpe_symbols": ("bpe", ["user_defined_symbols=<sep>,[MASK]"]),
}


def _run(args, cwd):
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.fixture(scope="module")
def checkpoint(request, tmp_path_factory):
    binary = request.config.getoption("--carry-binary")
    if not binary:
        pytest.skip("needs --carry-binary")
    d = tmp_path_factory.mktemp("sp_ck")
    (d / "run.textproto").write_text(RUN)
    r = _run([binary, "train", "run.textproto"], d)
    assert r.returncode == 0, r.stderr
    return d / "ck"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_exported_sentencepiece_encodes_as_sentencepiece(carry_binary, checkpoint, tmp_path, name):
    tokenizers = pytest.importorskip("tokenizers")
    model_type, options = MODELS[name]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 4) + "\n", encoding="utf-8")
    cmd = [carry_binary, "tokenize", "--train-sentencepiece", str(tmp_path / "m"), "--vocab-size", "600",
           "--model-type", model_type, "--input", str(corpus), "--spm-option", "hard_vocab_limit=false"]
    for o in options:
        cmd += ["--spm-option", o]
    r = _run(cmd, tmp_path)
    if r.returncode != 0 and "SentencePiece" in r.stderr and "not available" in r.stderr:
        pytest.skip("this carry was built without SentencePiece")
    assert r.returncode == 0, r.stderr
    model = tmp_path / "m.model"

    inputs = []
    for i, t in enumerate(TEXTS):
        f = tmp_path / f"doc{i}.txt"
        f.write_bytes(t.encode("utf-8"))
        inputs.append(str(f))
    r = _run([carry_binary, "tokenize", "--input", *inputs, "--output", str(tmp_path / "out.tok"), "--tokenizer",
              f"sentencepiece:{model}", "--threads", "1"], tmp_path)
    assert r.returncode == 0, r.stderr
    ids = _read_tokens(tmp_path / "out.tok")

    out = tmp_path / "hf"
    r = _run([carry_binary, "export", str(checkpoint), "--format", "hf", "--out", str(out), "--tokenizer",
              f"sentencepiece:{model}"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert (out / "tokenizer.model").read_bytes() == model.read_bytes()
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "</s>"
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    eod = tok.token_to_id("</s>")
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == eod
    # The token file: the end of document, then the document's ids, for each text in order.
    docs = []
    for t in ids:
        if t == eod:
            docs.append([])
        else:
            docs[-1].append(t)
    assert len(docs) == len(TEXTS)

    hf = [tok.encode(t).ids for t in TEXTS]
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    assert auto.eos_token_id == eod
    for text, want, got in zip(TEXTS, docs, hf):
        assert got == want, f"{name}: tokenizers gave other ids than SentencePiece for {text!r}"
        assert auto(text)["input_ids"] == want, f"{name}: AutoTokenizer gave other ids than SentencePiece for {text!r}"


def test_export_refuses_a_file_that_is_not_a_sentencepiece_model(carry_binary, checkpoint, tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"\x0a\xff\xff\xff\xff\x0f not a model")
    r = _run([carry_binary, "export", str(checkpoint), "--format", "hf", "--out", str(tmp_path / "hf"),
              "--tokenizer", f"sentencepiece:{bad}"], tmp_path)
    assert r.returncode != 0
    assert "not a SentencePiece model file" in r.stderr and str(bad) in r.stderr
    assert not (tmp_path / "hf").exists()
