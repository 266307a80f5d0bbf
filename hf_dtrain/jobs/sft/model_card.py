"""The model card ``hf-dtrain finetune`` writes next to an adapter (or a full fine-tune): a
``huggingface_hub.ModelCard`` with YAML metadata, the measured results, and the code that loads it back."""

from __future__ import annotations

import os

from huggingface_hub import ModelCard, ModelCardData

from hf_dtrain.settings import RELEASE

CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ model_name }}

{{ description }}

Trained with `hf-dtrain finetune --method {{ method }}{{ quant_flag }}` (hf_dtrain {{ version }}), on {{ dataset_desc }}.

## Results

| | before | after |
|---|---|---|
| eval loss | {% if eval_loss_before is not none %}{{ "%.4f"|format(eval_loss_before) }}{% else %}not measured{% endif %} | {{ "%.4f"|format(eval_loss_after) }} |
{% if accuracy_after is not none %}| exact-match accuracy | {% if accuracy_before is not none %}{{ "%.3f"|format(accuracy_before) }}{% else %}not measured{% endif %} | {{ "%.3f"|format(accuracy_after) }} |
{% endif %}
- trainable parameters: {{ trainable_params }} of {{ total_params }} ({{ "%.3f"|format(trainable_pct) }}%)
- steps: {{ max_steps }}, learning rate {{ learning_rate }}, batch {{ batch }} x {{ world_size }} process(es)
- train time: {{ "%.1f"|format(train_seconds) }} s

## Use

```python
import hf_dtrain  # registers hf_dtrain's peft methods (needed to load its adapters)
{{ usage }}
```
"""


def write_model_card(output_dir: str, results: dict, base_model: str) -> str:
    """Write ``README.md`` (a ``huggingface_hub.ModelCard`` with YAML metadata) into ``output_dir``; return its path."""
    full = results["method"] == "full"
    data = ModelCardData(
        base_model=base_model,
        library_name="transformers" if full else "peft",
        tags=["hf_dtrain", results["method"], "text-generation"],
        pipeline_tag="text-generation",
    )
    if full:
        usage = f'from transformers import AutoModelForCausalLM\nmodel = AutoModelForCausalLM.from_pretrained("{output_dir}")'
    else:
        quantize = results.get("quantize")
        if base_model.startswith("hf_dtrain/default-"):  # the default base: found or rebuilt in the local cache
            preset = base_model.removeprefix("hf_dtrain/default-")
            where, read = f'None, preset="{preset}"', f'preset="{preset}"'
        else:  # a folder, a hub id, or a GGUF file (dequantized once into a cached folder)
            where, read = f'"{base_model}"', f'model="{base_model}"'
        if quantize:  # the same 4-bit base the adapter was trained on
            group = results["config"]["quant_group_size"]
            load_base = (
                "from hf_dtrain.models import base_model_path\n"
                "from hf_dtrain.quantization import load_quantized_model\n"
                f"path = base_model_path({read})\n"
                f'base = load_quantized_model(path, "{quantize}", group_size={group})'
            )
        elif where.startswith("None") or base_model.lower().endswith(".gguf"):
            load_base = f"from hf_dtrain.models import load_model_and_tokenizer\nbase, tokenizer = load_model_and_tokenizer({where})"
        else:
            load_base = f'from transformers import AutoModelForCausalLM\nbase = AutoModelForCausalLM.from_pretrained("{base_model}")'
        usage = f'{load_base}\nfrom peft import PeftModel\nmodel = PeftModel.from_pretrained(base, "{output_dir}")'

    card = ModelCard.from_template(
        data,
        template_str=CARD_TEMPLATE,
        model_name=f"{results['method']} fine-tune of {base_model}",
        description=(
            "A full fine-tune."
            if full
            else f"A {results['method']} adapter"
            + (f" trained on the {results['quantize']} 4-bit base." if results.get("quantize") else ".")
        ),
        dataset_desc=results["dataset"],
        batch=results["per_device_train_batch_size"],
        usage=usage,
        quant_flag=f" --quantize {results['quantize']}" if results.get("quantize") else "",
        version=RELEASE,
        **results,
    )
    path = os.path.join(output_dir, "README.md")
    card.save(path)
    return path
