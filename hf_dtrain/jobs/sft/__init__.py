"""What the fine-tuning jobs (finetune, sweep, fed) share: their settings (:mod:`.config`: ``FinetuneConfig``), the
base model and data (:mod:`.data`), the Trainer's settings as flags (:mod:`.trainer_fields`) and the model card
(:mod:`.model_card`)."""
