"""`carry export --tokenizer byte` writes a tokenizer.json that Hugging Face's `tokenizers` reads and encodes
as carry's byte tokenizer does (ids = the bytes, <|endoftext|> = 256), beside config.json and
generation_config.json with that end-of-document id; transformers' AutoTokenizer loads the folder with no
other argument and gives the same ids and text. Needs the carry program (--carry-binary), `tokenizers` and
`transformers` (launcher/python_env installs them); each check is skipped without its package."""
import json
import os
import subprocess

import pytest

RUN = """name: "hf_export"
seed: 1
model { vocab_size: 300 d_model: 32 n_layers: 1 n_heads: 2 head_dim_k: 16 head_dim_v: 16
        mixers: "gated_deltanet" mixer_options { chunk_size: 16 conv_size: 4 } }
data { mqar { num_kv_pairs: 4 num_queries: 4 vocab_size: 300 } seq_len: 64 batch_size: 1 }
optimizer { lr: 1e-3 warmup_steps: 1 total_steps: 1 }
checkpoint { dir: "ck" every_steps: 1 }
"""


TEXT = "héllo wörld\n\t12 ☃ end"


def _export(carry_binary, tmp_path):
    (tmp_path / "run.textproto").write_text(RUN)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([carry_binary, "train", "run.textproto"], cwd=tmp_path, env=env, check=True,
                   capture_output=True)
    subprocess.run([carry_binary, "export", "ck", "--format", "hf", "--out", "hf", "--tokenizer", "byte"],
                   cwd=tmp_path, env=env, check=True, capture_output=True)
    return tmp_path / "hf"


def test_exported_byte_tokenizer_reads_in_hugging_face(carry_binary, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    out = _export(carry_binary, tmp_path)
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    text = TEXT
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.token_to_id("<|endoftext|>") == 256
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 256
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"


def test_exported_folder_loads_in_autotokenizer(carry_binary, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = _export(carry_binary, tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = tok(TEXT)["input_ids"]
    assert ids == list(TEXT.encode("utf-8"))  # no special token added around the text
    assert tok.decode(ids) == TEXT
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 256
    assert tok.convert_ids_to_tokens(256) == "<|endoftext|>"
