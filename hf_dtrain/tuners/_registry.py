"""Registration of hf_dtrain's tuners with peft, and what every tuner config shares.

peft's ``PeftType`` is a closed ``str`` enum and ``peft.utils.register_peft_method`` requires the method's name to be
a member already. We add the member when the config module is imported (a real enum member, inserted into the enum's
member maps), then hand the config and model classes to peft's own registration function.

Each tuner folder registers itself, as peft's folders do: its ``model.py`` defines ``register_with_peft()``, and every
module of the folder ends with :func:`register_folder` (whichever module of an import finishes last does it; a module
still being imported cannot be used yet). ``hf_dtrain.tuners.register_with_peft`` imports every folder when peft is
imported (``import hf_dtrain`` arranges that), so ``PeftModel.from_pretrained`` knows the methods.

Both steps are idempotent: importing ``hf_dtrain`` twice, or ``importlib.reload``-ing a tuner module (which creates new
class objects), leaves exactly one enum member and one mapping entry per method, pointing at the newest classes.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass

from peft.config import PeftConfig
from peft.mapping import PEFT_TYPE_TO_PREFIX_MAPPING
from peft.utils import PeftType, register_peft_method

from hf_dtrain.errors import SettingsError
from hf_dtrain.settings import RELEASE as release
from hf_dtrain.settings import setting

from . import importing, register_with_peft

# Prefixes already used by peft; ours must be neither a substring nor a superstring of any of them, because peft
# selects trainable parameters and saved tensors by substring match on the prefix.
_FORBIDDEN_FRAGMENTS = ("lora_", "hira_")


def extend_peft_type(name: str) -> PeftType:
    """Return ``PeftType[name]``, adding it to the enum first if peft does not know it (idempotent)."""
    if not name.isupper() or not name.replace("_", "").isalnum():
        raise SettingsError(f"PeftType member names are upper-case identifiers, got {name!r}.")
    if name in PeftType.__members__:
        return PeftType[name]
    member = str.__new__(PeftType, name)
    member._name_ = name
    member._value_ = name
    member.__objclass__ = PeftType
    member.__init__(name)
    PeftType._member_map_[name] = member
    PeftType._value2member_map_[name] = member
    PeftType._member_names_.append(name)
    # Attribute access (``PeftType.SMT``), used by peft's register_peft_method, goes through the class dict.
    type.__setattr__(PeftType, name, member)
    return member


def _check_prefix(prefix: str) -> None:
    for fragment in _FORBIDDEN_FRAGMENTS:
        if fragment in prefix:
            raise SettingsError(f"Prefix {prefix!r} contains peft's {fragment!r}; pick another prefix.")
    for peft_type, other in PEFT_TYPE_TO_PREFIX_MAPPING.items():
        if other == prefix:
            continue
        if other in prefix or prefix in other:
            raise SettingsError(
                f"Prefix {prefix!r} collides with {other!r} of PeftType {peft_type}; peft matches prefixes by "
                "substring, so pick a prefix that is neither a substring nor a superstring of another."
            )


def saved_peft_type(name: str) -> str:
    """The ``peft_type`` an hf_dtrain adapter's ``adapter_config.json`` holds: the method's name and the import
    that registers it. peft looks the saved value up in its mapping, so without ``import hf_dtrain`` the user's
    traceback ends ``KeyError: 'SMT: an hf_dtrain adapter ... import hf_dtrain ...'``, naming the fix, instead of a
    bare ``KeyError: 'SMT'``. Registration maps this value and the bare name (files written before) to the config
    class; the loaded config's ``peft_type`` is the enum member again. The text never changes between releases."""
    return f"{name}: an hf_dtrain adapter; run `import hf_dtrain` before loading it (pip install hf-dtrain)"


def register(name: str, config_cls: type, model_cls: type, prefix: str) -> PeftType:
    """Register a tuner with peft, idempotently. ``name`` is lower case (``"smt"``); returns its PeftType member."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING

    peft_type = extend_peft_type(name.upper())
    if peft_type in PEFT_TYPE_TO_CONFIG_MAPPING or peft_type in PEFT_TYPE_TO_TUNER_MAPPING:
        registered_prefix = PEFT_TYPE_TO_PREFIX_MAPPING.get(peft_type)
        if registered_prefix != prefix:
            raise SettingsError(
                f"PeftType {peft_type.value} is already registered with prefix {registered_prefix!r}, not {prefix!r}."
            )
        # A reload created new classes: point peft at them so configs and models stay consistent, and the folder's
        # public names too (its lazy exports keep what they first loaded)
        PEFT_TYPE_TO_CONFIG_MAPPING[peft_type] = config_cls
        PEFT_TYPE_TO_TUNER_MAPPING[peft_type] = model_cls
        for cls in (config_cls, model_cls):
            folder = sys.modules.get(cls.__module__.rpartition(".")[0])
            if folder is not None and cls.__name__ in folder.__dict__:
                folder.__dict__[cls.__name__] = cls
    else:
        _check_prefix(prefix)
        register_peft_method(name=name, config_cls=config_cls, model_cls=model_cls, prefix=prefix)
    PEFT_TYPE_TO_CONFIG_MAPPING[saved_peft_type(peft_type.value)] = config_cls  # what our adapter files hold
    return peft_type


def register_folder(module: str) -> None:
    """The last line of every module of a tuner folder: register the folder's method with peft (its
    ``model.register_with_peft``), unless another module of the folder is still being imported; that module's own
    last line registers it then."""
    package = module.rpartition(".")[0]
    if not importing(package + ".", skip=module):
        importlib.import_module(f"{package}.model").register_with_peft()


MODEL_CARD_MARK = "<!-- hf_dtrain -->"


@dataclass
class HfDtrainPeftConfig(PeftConfig):
    """What every hf_dtrain tuner config adds to peft's ``PeftConfig``: the fields every method has, its
    ``PeftType`` member (``peft_type_name``), and a ``save_pretrained`` that also tells the reader of the adapter's
    README (the model card peft writes just before the config) that loading needs ``import hf_dtrain``, which
    registers the method with peft, and which release wrote it; the saved ``peft_type`` is
    :func:`saved_peft_type`'s, so peft's ``KeyError`` without the import names the import."""

    peft_type_name = ""  # the PeftType member, e.g. "SMT" (a class attribute, not a field)

    exclude_modules: list[str] | str | None = setting(None, "Module names or a regex of modules not to adapt.")
    modules_to_save: list[str] | None = setting(
        None, "Modules besides the adapters to train and save in full, e.g. ['lm_head']."
    )
    init_weights: bool = setting(
        True,
        "True: the adapter starts as the identity (its delta is zero). False: a small random non-zero "
        "start, as peft's own methods take it (for testing merges and save/load round trips).",
    )

    def __post_init__(self):
        super().__post_init__()
        self.peft_type = extend_peft_type(self.peft_type_name)
        for name in ("target_modules", "exclude_modules"):
            if isinstance(getattr(self, name, None), list):
                setattr(self, name, set(getattr(self, name)))

    def positive_ints(self, *names: str) -> None:
        """``ValueError`` unless each of ``names`` is a positive integer (None is taken where the field allows it)."""
        for name in names:
            value = getattr(self, name)
            if value is None and self.__dataclass_fields__[name].default is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SettingsError(f"{type(self).__name__}.{name} must be a positive integer, got {value!r}.")

    def save_pretrained(self, save_directory: str, **kwargs) -> None:
        super().save_pretrained(save_directory, **kwargs)

        method = str(getattr(self.peft_type, "value", self.peft_type))
        # the file's peft_type names hf_dtrain and the import (peft's KeyError without it then says so)
        from peft.utils import CONFIG_NAME

        path = os.path.join(save_directory, CONFIG_NAME)
        with open(path) as f:
            saved = json.load(f)
        saved["peft_type"] = saved_peft_type(method)
        with open(path, "w") as f:
            json.dump(saved, f, indent=2, sort_keys=True)
        card = os.path.join(save_directory, "README.md")
        text = open(card).read() if os.path.exists(card) else ""
        if MODEL_CARD_MARK in text:
            return
        note = (
            f"\n{MODEL_CARD_MARK}\n## Loading this adapter\n\nThis is a **{method}** adapter from "
            f"[hf_dtrain](https://pypi.org/project/hf-dtrain/) {release}. peft knows the method once hf_dtrain "
            f"is imported:\n\n```python\nimport hf_dtrain  # registers {method} with peft (pip install "
            f"hf-dtrain=={release})\nfrom peft import AutoPeftModelForCausalLM\nmodel = "
            'AutoPeftModelForCausalLM.from_pretrained("path/to/this/adapter")\n```\n\nWithout the import, '
            f"peft stops with `KeyError: '{saved_peft_type(method)}'`.\n"
        )
        with open(card, "a") as f:
            f.write(note)


register_with_peft(caller=__name__)  # peft may have been imported by this module: the folders load now
