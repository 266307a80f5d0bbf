"""hf_dtrain's peft tuners, one folder per method (``config.py``, ``layer.py``, ``model.py`` and ``method.py``).

Importing this package is light: it imports every folder, whose ``method.py`` registers the method with the jobs
(:mod:`hf_dtrain.tuners.finetune_method`). The peft classes load on first use, and each folder registers itself with
peft as its modules load (:mod:`hf_dtrain.tuners._registry`); :func:`register_with_peft` loads every folder, which
``import hf_dtrain`` runs as soon as peft is imported. A folder added here is found without any edit elsewhere.

A method from another package registers the same way from its own modules (``register_peft_tuner`` for peft,
``register_finetune_method`` for the jobs) and names the module that does so as an ``hf_dtrain.methods`` entry
point, which this package imports after its folders.
"""

import importlib
import importlib.metadata
import pkgutil
import sys

FOLDERS = tuple(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg)
_folders = {name: importlib.import_module(f"{__name__}.{name}") for name in FOLDERS}
# what a tuner outside hf_dtrain builds on: name -> (module, attribute)
_SHARED = {
    "HfDtrainPeftConfig": ("_registry", "HfDtrainPeftConfig"),
    "register_peft_tuner": ("_registry", "register"),
    "LinearTunerModel": ("_base", "LinearTunerModel"),
    "MergeableLinearMixin": ("_base", "MergeableLinearMixin"),
}


def importing(prefix: str, skip: str | None = None) -> bool:
    """Whether a module whose name starts with ``prefix`` (other than ``skip``) is still being imported: it is in
    ``sys.modules`` but partially initialised, so its names cannot be used yet."""
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if name.startswith(prefix) and name != skip and getattr(spec, "_initializing", False):
            return True
    return False


def register_with_peft(caller: str | None = None) -> None:
    """Load every tuner folder's peft classes, which registers each with peft. Run when peft is imported, and at the
    end of the tuners' shared modules (``caller``): while one of those is still being imported nothing can load (its
    own end runs this again), and a folder still being imported registers itself when it finishes."""
    if importing(f"{__name__}._", skip=caller):
        return
    for name in FOLDERS:
        package = f"{__name__}.{name}"
        if not importing(package + "."):
            importlib.import_module(f"{package}.model")


def __getattr__(name: str):
    """The folders' public names (``hf_dtrain.tuners.LoraFAConfig``) and the shared bases, loaded on first use."""
    if name in _SHARED:
        module, attribute = _SHARED[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
    for folder in _folders.values():
        if name in getattr(folder, "__all__", ()):
            return getattr(folder, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted({*_SHARED, *(n for folder in _folders.values() for n in getattr(folder, "__all__", ()))})

# other packages' methods, last: their modules may import this package's names
for _entry in importlib.metadata.entry_points(group="hf_dtrain.methods"):
    _entry.load()
