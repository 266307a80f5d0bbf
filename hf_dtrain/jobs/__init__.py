"""The jobs: each a short composition of the run's sections (:mod:`hf_dtrain.run`) and the engines, and none
importing another: ``finetune``, ``pretrain``, ``sweep``, ``fed``, ``plan``, ``elastic``. What the fine-tuning jobs
share (their config, their data, the model card) is :mod:`hf_dtrain.jobs.sft`."""
