#!/usr/bin/env python3
# The FLA cross-check of `carry export` (run on a GPU machine with flash-linear-attention installed;
# tests/fla/make_export_check_inputs.sh makes the inputs, README.md "Using a trained model" gives the
# commands). For each exported folder:
#   1. strict load: the folder's model.safetensors goes into FLA's model class (config.json's
#      architectures[0], from fla.models) with load_state_dict(strict=True): no missing, no unexpected
#      key, every shape equal (a tied head is the embedding, as transformers ties it); then the same
#      folder through transformers' AutoModelForCausalLM.from_pretrained, whose loading report must be
#      empty too;
#   2. logits: FLA's model on the tokens carry scored (the `tokens` of carry's logits file, written by
#      `carry eval --dump-logits`), in fp32 and in bf16, against carry's fp32 logits: the max relative
#      error max|fla - carry| / max|carry| and the share of positions whose argmax agrees.
#   3. tokenizer and generation (where the folder has carry_generate.txt): transformers' AutoTokenizer reads
#      the folder's tokenizer files and encodes the prompt's text to carry's ids; the model from
#      AutoModelForCausalLM, fp32, draws a greedy continuation (model.generate, do_sample=False, as many new
#      tokens as carry drew, no stop token) that must equal `carry generate --temperature 0`'s token for token.
# One table row per folder and precision (and one for the generation), then one verdict line. Exit status 0 when every row passes
# (fp32: rel err <= 2e-3, FLA's kernels use TF32 dot products; bf16: <= 5e-2), 1 otherwise.
#
# usage: python3 tests/fla/export_check.py FOLDER [FOLDER ...]   (carry's logits: FOLDER/carry_logits.safetensors)
import argparse
import json
import os
import sys

import torch


def check(folder, device):
    import fla  # noqa: F401  (registers FLA's classes with transformers)
    import fla.models
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    arch = config["architectures"][0]
    cls = getattr(fla.models, arch)
    model = cls(cls.config_class.from_pretrained(folder))
    state = load_file(os.path.join(folder, "model.safetensors"))
    if config.get("tie_word_embeddings") and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embeddings.weight"]
    result = model.load_state_dict(state, strict=True)  # raises on a missing, unexpected or misshapen key
    try:
        auto, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    except TypeError:  # transformers before 4.56 names it torch_dtype
        auto, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, torch_dtype=torch.float32)
    tied = {"lm_head.weight"} if config.get("tie_word_embeddings") else set()
    problems = {k: v for k, v in info.items() if v and set(v) - (tied if k == "missing_keys" else set())}
    if problems:
        raise RuntimeError(f"{folder}: transformers' loading report is not empty: {problems}")
    if type(auto).__name__ != arch:
        raise RuntimeError(f"{folder}: AutoModelForCausalLM gave {type(auto).__name__}, config.json says {arch}")
    generation = generate_row(folder, auto, device)
    del auto

    ref = load_file(os.path.join(folder, "carry_logits.safetensors"))
    tokens, carry = ref["tokens"].to(device), ref["logits"].float().to(device)
    rows = []
    model = model.to(device).eval()
    for name, dtype, bound in [("fp32", torch.float32, 2e-3), ("bf16", torch.bfloat16, 5e-2)]:
        with torch.no_grad():
            try:
                logits = model.to(dtype)(input_ids=tokens).logits.float()
            except AssertionError as e:
                # FLA's chunked DeltaNet kernel takes no fp32 ("does not support float32"): its
                # recurrent kernel computes the same function, so the fp32 row runs that one.
                modes = [m for m in model.modules() if getattr(m, "mode", None) == "chunk"]
                if dtype != torch.float32 or "float32" not in str(e) or not modes:
                    raise
                for m in modes:
                    m.mode = "fused_recurrent"
                logits = model.to(dtype)(input_ids=tokens).logits.float()
                for m in modes:
                    m.mode = "chunk"
                name = "fp32 (FLA's fused_recurrent kernel)"
        err = ((logits - carry).abs().max() / carry.abs().max()).item()
        agree = (logits.argmax(-1) == carry.argmax(-1)).float().mean().item()
        rows.append((folder, arch, name, tuple(tokens.shape), err, agree, err <= bound, bound))
    return len(state), rows, generation


def recurrent_modes(model):
    """Every FLA layer of `model` on its fused_recurrent kernel (FLA's chunked kernels take no fp32 for some
    families; the recurrent kernel computes the same function)."""
    for m in model.modules():
        if getattr(m, "mode", None) == "chunk":
            m.mode = "fused_recurrent"


def generate_row(folder, auto, device):
    """(tokenizer ids equal, new tokens equal, how many, leading tokens that agree) against carry_generate.txt,
    or None when the folder has none."""
    path = os.path.join(folder, "carry_generate.txt")
    if not os.path.exists(path):
        return None
    from transformers import AutoTokenizer

    lines = [l for l in open(path).read().split("\n") if l.strip()]
    prompt = [int(x) for x in lines[0].split(",")]
    want = [int(x) for x in lines[1].split()]
    tok = AutoTokenizer.from_pretrained(folder)
    ids_equal = tok(bytes(prompt).decode("utf-8"))["input_ids"] == prompt
    model = auto.to(device).float().eval()
    recurrent_modes(model)
    model.generation_config.eos_token_id = None  # carry drew with --stop-token none
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=len(want), do_sample=False,
                             pad_token_id=0)
    got = out[0, len(prompt):].tolist()
    lead = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return ids_equal, got == want, len(want), lead


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("folders", nargs="+")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    import fla
    print(f"torch {torch.__version__}, fla {getattr(fla, '__version__', '?')}, device "
          f"{torch.cuda.get_device_name() if a.device == 'cuda' else a.device}", flush=True)
    print(f"| folder | FLA class | tensors (strict) | precision | tokens [B, T] | max rel err vs carry | argmax agrees | bound | ok |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for folder in a.folders:
        try:
            n, rows, generation = check(folder, a.device)
        except Exception as e:  # one line per folder that fails to load or run
            print(f"| {folder} | - | FAILED: {type(e).__name__}: {str(e)[:300]} | | | | | | no |")
            ok = False
            continue
        for folder_, arch, name, shape, err, agree, passed, bound in rows:
            print(f"| {os.path.basename(folder_.rstrip('/'))} | {arch} | {n} | {name} | {list(shape)} | {err:.2e} | "
                  f"{agree:.4f} | {bound:g} | {'yes' if passed else 'no'} |")
            ok = ok and passed
        if generation is not None:
            ids_equal, equal, count, lead = generation
            print(f"| {os.path.basename(folder.rstrip('/'))} | AutoTokenizer + generate | | greedy, fp32 | "
                  f"prompt ids {'equal' if ids_equal else 'DIFFER'} | | {lead}/{count} new tokens equal carry's | "
                  f"all | {'yes' if ids_equal and equal else 'no'} |")
            ok = ok and ids_equal and equal
    print(f"FLA cross-check: {'PASS' if ok else 'FAIL'} ({len(a.folders)} folder(s))")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
