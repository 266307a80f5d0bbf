import importlib
import json
import sys

from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_PREFIX_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
from peft.utils import PeftType

import hf_dtrain
import hf_dtrain.tuners
import hf_dtrain.tuners.smt.config
from hf_dtrain import processes
from hf_dtrain.tuners._registry import saved_peft_type


def _state():
    return {
        name: (
            [m.name for m in PeftType].count(name),
            PEFT_TYPE_TO_PREFIX_MAPPING[PeftType[name]],
            PEFT_TYPE_TO_CONFIG_MAPPING[PeftType[name]].__name__,
            PEFT_TYPE_TO_TUNER_MAPPING[PeftType[name]].__name__,
        )
        for name in ("SMT", "LORAFA")
    }


def test_registered_with_expected_prefixes():
    assert _state() == {
        "SMT": (1, "smt_", "SMTConfig", "SMTModel"),
        "LORAFA": (1, "lorafa_", "LoraFAConfig", "LoraFAModel"),
    }
    assert PeftType("SMT") is PeftType.SMT is PeftType["SMT"]
    assert PEFT_TYPE_TO_PREFIX_MAPPING[PeftType.QAHIRA] == "qahr_"
    for prefix in ("smt_", "lorafa_", "qahr_"):
        assert "lora_" not in prefix and "hira_" not in prefix


def test_registration_is_idempotent_across_import_and_reload():
    before = _state()
    n_members = len(PeftType)
    importlib.import_module("hf_dtrain")
    importlib.reload(hf_dtrain.tuners.smt.config)
    importlib.reload(hf_dtrain.tuners)
    importlib.reload(hf_dtrain)
    assert _state() == before
    assert len(PeftType) == n_members
    # after a reload peft points at the newest classes, so configs built from them resolve consistently
    assert PEFT_TYPE_TO_CONFIG_MAPPING[PeftType.SMT] is hf_dtrain.SMTConfig
    cfg = hf_dtrain.SMTConfig(num_blocks=1, block_size=16)
    assert cfg.peft_type is PeftType.SMT


def test_peft_type_is_json_serialisable_and_config_round_trips(tmp_path):
    cfg = hf_dtrain.LoraFAConfig(r=4, target_modules=["q_proj"])
    cfg.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["peft_type"] == saved_peft_type("LORAFA")
    from peft import PeftConfig

    loaded = PeftConfig.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "LoraFAConfig" and loaded.r == 4


def test_loading_without_import_fails_loudly_naming_the_type(tmp_path):
    hf_dtrain.LoraFAConfig(r=4, target_modules=["q_proj"]).save_pretrained(tmp_path)
    code = f"from peft import PeftConfig\nPeftConfig.from_pretrained({str(tmp_path)!r})"
    proc = processes.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    # Without `import hf_dtrain` peft cannot know the type: it fails (it must not silently load something else),
    # and the line its traceback ends with names hf_dtrain and the import (the saved peft_type says so)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and last == f"KeyError: '{saved_peft_type('LORAFA')}'", proc.stderr[-2000:]
    assert "run `import hf_dtrain` before loading it" in last
