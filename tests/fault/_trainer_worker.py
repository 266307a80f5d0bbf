"""A Trainer run with InMemoryFaultToleranceCallback: optionally SIGKILLed after step $FT_KILL_AT, and on start
resumed with ``trainer.train(resume_from_checkpoint=ft.resume_checkpoint(trainer))``. Writes the logged losses to
``$FT_OUT/losses.json`` (appending runs), the restore source to ``$FT_OUT/restored.json`` and, at the end, the model's
parameters and the optimizer's state to ``$FT_OUT/final.safetensors``."""

import json
import os
import signal

from datasets import Dataset
from safetensors.torch import save_file
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_dtrain.fault import InMemoryFaultToleranceCallback
from hf_dtrain.testing import random_batch, tiny_llama

out = os.environ["FT_OUT"]
kill_at = int(os.environ.get("FT_KILL_AT", "0"))
# FT_KILLS / FT_GEN: this generation's kill, "gen:step:phase" entries (phases: startup, before_step, step_end; a
# step counted from this generation's first step)
gen = os.environ.get("FT_GEN", "0")
kill = next((e.split(":")[1:] for e in os.environ.get("FT_KILLS", "").split(",") if e.split(":")[0] == gen), None)


def die(phase):
    with open(os.path.join(out, "kills"), "a") as f:
        f.write(f"{gen}:{phase}\n")
    os.kill(os.getpid(), signal.SIGKILL)


rows = [{k: v[0].tolist() for k, v in random_batch(batch=1, seq=16, seed=s).items()} for s in range(48)]


class Log(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            with open(os.path.join(out, "losses.jsonl"), "a") as f:
                f.write(json.dumps([state.global_step, logs["loss"]]) + "\n")
        # after the step's log line and its snapshot (the callback takes it in on_log, before this callback)
        if state.global_step == kill_at:
            ft.engine.wait()  # the snapshot of this step is in (a kill mid-copy is the engine tests' case)
            ft.engine.persister.join()  # and so is its disk copy, if one is written
            os.kill(os.getpid(), signal.SIGKILL)
        if kill and kill[1] == "step_end" and state.global_step == first + int(kill[0]) - 1:
            ft.engine.wait()
            die("step_end")

    def on_pre_optimizer_step(self, args, state, control, **kw):
        if kill and kill[1] == "before_step" and state.global_step + 1 == first + int(kill[0]) - 1:
            die("before_step")


callbacks = [Log()]
ft = None
if not os.environ.get("FT_NOFT"):
    # FT_PERSIST: every snapshot also written there (the disk copy a lost node is resumed from)
    disk = {"persist_dir": os.environ["FT_PERSIST"], "persist_every": 1} if os.environ.get("FT_PERSIST") else {}
    ft = InMemoryFaultToleranceCallback(every_n_steps=1, directory=os.environ["FT_DIR"], **disk)
    callbacks.insert(0, ft)
args = TrainingArguments(
    output_dir=os.path.join(out, "trainer"),
    max_steps=10,
    per_device_train_batch_size=4,
    report_to=[],
    use_cpu=True,
    save_strategy="no",
    logging_steps=1,
    disable_tqdm=True,
    seed=0,
    learning_rate=3e-3,
    lr_scheduler_type="linear",
    warmup_steps=2,
    dataloader_num_workers=0,
)
trainer = Trainer(model=tiny_llama(seed=0), args=args, train_dataset=Dataset.from_list(rows), callbacks=callbacks)
if kill and kill[1] == "startup":
    die("startup")
resume = ft.resume_checkpoint(trainer) if ft is not None else None
first = (ft.restored.step + 1) if ft is not None and ft.restored is not None else 1
if ft is not None and ft.restored is not None:
    json.dump({"step": ft.restored.step, "source": ft.restored.source}, open(os.path.join(out, "restored.json"), "w"))
trainer.train(resume_from_checkpoint=resume)
json.dump(trainer.state.log_history, open(os.path.join(out, "history.json"), "w"))
final = {f"param.{n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
for i, state in trainer.optimizer.state_dict()["state"].items():
    final.update({f"optim.{i}.{k}": v.clone() for k, v in state.items() if hasattr(v, "clone")})
save_file(final, os.path.join(out, "final.safetensors"))
