#!/usr/bin/env bash
# The inputs of tests/fla/export_check.py: five small byte-level models trained 40 steps on this
# repository's README.md (on the CPU: GPUs hidden), each exported to an FLA folder holding carry's
# fp32 logits on two 256-token sequences (carry_logits.safetensors), the byte tokenizer's Hugging Face files
# (carry export --tokenizer byte) and carry's greedy continuation of a prompt (carry_generate.txt: the prompt's
# ids, comma-separated, then the 64 new ids, `carry generate --temperature 0 --stop-token none`):
#   OUT/gdn  Gated DeltaNet, short convolutions, its own head (expand_v 2)
#   OUT/dn   DeltaNet, short convolutions, tied head
#   OUT/gla  GLA without convolutions, tied head (expand_k 0.5)
#   OUT/rwkv7  RWKV-7 as RWKV7ForCausalLM: LayerNorms, the first block's pre-norm, the channel mix, its own head
#   OUT/kda  KDA as KDAForCausalLM: short convolutions, its own head (head_dim 64, expand_v 1)
# usage: tests/fla/make_export_check_inputs.sh [CARRY_BINARY] [OUT]   (defaults: build/bin/carry .fla_check)
# then:  python3 tests/fla/export_check.py OUT/gdn OUT/dn OUT/gla OUT/rwkv7 OUT/kda
set -euo pipefail
carry=${1:-build/bin/carry}
out=${2:-.fla_check}
mkdir -p "$out"
export CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1
"$carry" tokenize --input README.md --output "$out/corpus.tok"
cat > "$out/run.textproto" <<EOF
name: "fla_check"
seed: 7
model { vocab_size: 257 d_model: 128 n_layers: 2 n_heads: 2 head_dim_k: 64 head_dim_v: 128 tie_embeddings: false
        mixers: "gated_deltanet" mixer_options { chunk_size: 64 conv_size: 4 } }
data { token_files { paths: "$out/corpus.tok" } seq_len: 128 batch_size: 4 }
optimizer { lr: 3e-3 warmup_steps: 5 total_steps: 40 weight_decay: 0 }
logging { every_steps: 40 }
EOF
train() {  # name, overrides...
  local name=$1
  shift
  rm -rf "$out/ck_$name"
  "$carry" train "$out/run.textproto" --set "checkpoint.dir=$out/ck_$name" "$@" | grep -E '^step +40/'
  "$carry" export "$out/ck_$name" --format fla --out "$out/$name" --tokenizer byte
  "$carry" eval "$out/ck_$name" --cpu --data "$out/corpus.tok" --seq-len 256 --max-sequences 2 --batch-size 2 \
    --dump-logits "$out/$name/carry_logits.safetensors" | grep '^eval:'
  echo "$prompt" > "$out/$name/carry_generate.txt"
  "$carry" generate "$out/ck_$name" --cpu --prompt-ids "$prompt" --tokenizer ids --temperature 0 --max-new-tokens 64 \
    --stop-token none 2>/dev/null >> "$out/$name/carry_generate.txt"
}
# The prompt: the ids (bytes) of a line of ASCII text.
prompt=$(printf '%s' "carry trains linear attention on long sequences" | od -An -tu1 | tr -s ' \n' ',' | sed 's/^,//; s/,$//')
train gdn
train dn --set model.mixers=deltanet --set model.head_dim_v=64 --set model.tie_embeddings=true
train gla --set model.mixers=gla --set model.head_dim_k=32 --set model.head_dim_v=64 --set model.tie_embeddings=true \
  --set 'model.mixer_options[0].conv_size=0'
train rwkv7 --set model.mixers=rwkv7 --set model.head_dim_v=64 --set 'model.mixer_options[0].conv_size=0' \
  --set model.feed_forward=rwkv7_channel_mix --set model.mlp_ratio=4 --set model.norm=layer_norm --set model.pre_norm=true \
  --set model.norm_eps=1e-5
train kda --set model.mixers=kda --set model.head_dim_v=64
echo "inputs in $out: python3 tests/fla/export_check.py $out/gdn $out/dn $out/gla $out/rwkv7 $out/kda"
