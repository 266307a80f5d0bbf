#!/usr/bin/env bash
# Regenerate the model cards of the reference runs: run each recipe with `hf-dtrain finetune` and copy the card it
# writes (huggingface_hub.ModelCard, with the measured figures) here. About 2 minutes per recipe on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
for recipe in lora lorafa smt; do
  hf-dtrain finetune --recipe "recipes/finetune_${recipe}.yaml" --output-dir "outputs/reference-${recipe}" --progress false
  cp "outputs/reference-${recipe}/README.md" "model_cards/hf_dtrain-default-tiny-${recipe}-addition.md"
done
