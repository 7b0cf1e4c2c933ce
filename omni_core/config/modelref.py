"""Model references: a local directory, ``omni-tiny/<family>`` or a hub id in the local HF cache.

Nothing here downloads: a hub id must already be in the local Hugging Face cache, and a tiny
checkpoint is written by its family plugin on first use.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_core.errors import ConfigError, UnknownModelError
from omni_core.refs import load_ref

if TYPE_CHECKING:
    from omni_core.plugins import PluginHost

TINY_PREFIX = "omni-tiny/"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def cache_dir() -> Path:
    """Omni's cache root: ``$OMNI_CACHE`` or ``~/.cache/omni``."""
    return Path(os.environ.get("OMNI_CACHE") or Path.home() / ".cache" / "omni").expanduser()


def resolve_model_path(model_ref: str, plugins: PluginHost) -> Path:
    """Turn a model reference into a local checkpoint directory.

    Tried in order: an existing local directory; ``omni-tiny/<family>`` (written on first use into
    ``<cache>/tiny/<family>`` by the family's ``make_tiny``, ``<family>.v<N>`` from its
    ``tiny_format`` 2 on); a hub id ``org/name`` found in the
    local Hugging Face cache. Anything else raises `UnknownModelError` saying what was tried.
    """
    if not model_ref.strip():
        # Path("") is the current directory: never serve it by accident.
        raise UnknownModelError(
            "empty model reference: pass a checkpoint directory, a hub id or omni-tiny/<family>"
        )
    local = Path(model_ref).expanduser()
    if local.is_dir():
        return local.resolve()
    if model_ref.startswith(TINY_PREFIX):
        return _tiny_checkpoint(model_ref[len(TINY_PREFIX) :], plugins)
    if local.exists():
        raise UnknownModelError(f"model {model_ref!r} is a file; pass the checkpoint's directory")
    if _HUB_ID.match(model_ref):
        return _hub_snapshot(model_ref)
    raise UnknownModelError(
        f"model {model_ref!r} is not a local directory, not 'omni-tiny/<family>' and not a hub id "
        "'org/name'; pass the path of a checkpoint directory"
    )


CONFIG_FILES = ("config.json", "model_index.json", "modular_model_index.json")


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint's ``config.json`` (transformers), ``model_index.json`` (diffusers) or
    ``modular_model_index.json`` (a diffusers modular pipeline, e.g. MiniMax-H3)."""
    directory = Path(path)
    for name in CONFIG_FILES:
        file = directory / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {file}: {exc}", key=name) from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{file} must hold a JSON object, not {type(data).__name__}", key=name)
        return data
    inside = sorted(
        sub.name for sub in (directory.iterdir() if directory.is_dir() else ()) if sub.is_dir() and any((sub / n).is_file() for n in CONFIG_FILES)
    )
    hint = f"; these folders in it are: serve one of {', '.join(str(directory / n) for n in inside)}" if inside else ": is it a Hugging Face checkpoint?"
    raise UnknownModelError(f"{directory} has neither config.json nor model_index.json (nor a modular_model_index.json){hint}")


def _tiny_checkpoint(family_name: str, plugins: PluginHost) -> Path:
    family = plugins.families.get(family_name)
    if family is None or family.make_tiny is None:
        tiny = sorted(name for name, fam in plugins.families.items() if fam.make_tiny)
        raise UnknownModelError(
            f"no installed family writes tiny checkpoints named {family_name!r}; "
            f"available: {', '.join(TINY_PREFIX + name for name in tiny) or 'none'} "
            "(install the family's plugin, e.g. `pip install omni-qwen3`)"
        )
    root = cache_dir() / "tiny"
    # A new format gets a directory of its own: one written by an older plugin is never reused.
    target = root / (family_name if family.tiny_format == 1 else f"{family_name}.v{family.tiny_format}")
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # The lock spares concurrent first uses the (slow) duplicate build; the rename alone already
    # guarantees nobody ever sees a half-written checkpoint.
    with _file_lock(root / f".{family_name}.lock"):
        if target.is_dir():
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{family_name}-", dir=root))
        try:
            load_ref(family.make_tiny)(staging, "tiny")
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():
                raise
            # Another process without the lock (e.g. on a filesystem without flock) won the race.
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename alone
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    # huggingface_hub reads HF_HUB_CACHE once at import; reading it here honours a later setting.
    hub_cache = os.environ.get("HF_HUB_CACHE") or None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, cache_dir=hub_cache))
    except Exception as exc:  # LocalEntryNotFoundError, HFValidationError, ...: all mean "not here"
        raise UnknownModelError(
            f"model {repo_id!r} is not a local directory and not in the local Hugging Face cache "
            f"({type(exc).__name__}); download it first (`huggingface-cli download {repo_id}`) "
            "or pass a checkpoint directory"
        ) from exc


CHECKPOINT_DTYPE = "checkpoint"
"""A stage's ``dtype`` option that means the checkpoint's own dtype (`checkpoint_dtype`)."""

_DTYPES = ("float32", "bfloat16", "float16")
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def checkpoint_dtype(path: str | Path) -> str:
    """The dtype a checkpoint's weights are stored in: ``"float32"``, ``"bfloat16"`` or ``"float16"``.

    As transformers' ``torch_dtype="auto"``: the ``dtype`` (or older ``torch_dtype``) of its
    ``config.json``, else the first floating-point tensor of its first safetensors file (read from
    the file's header only); then the same in its component folders (a diffusers-style layout).
    """
    directory = Path(path)
    folders = [directory]
    if directory.is_dir():
        folders += sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
    for folder in folders:
        found = _config_dtype(folder) or _weights_dtype(folder)
        if found is not None:
            return found
    raise ConfigError(
        f"dtype {CHECKPOINT_DTYPE!r}: {directory} names no dtype (config.json's dtype / torch_dtype) and has no "
        "floating-point safetensors weights; set the stage's dtype to float32, bfloat16 or float16"
    )


def resolve_dtype(dtype: str, path: str | Path) -> str:
    """`dtype` itself, or the checkpoint's at `path` when it is ``"checkpoint"``."""
    return checkpoint_dtype(path) if dtype == CHECKPOINT_DTYPE else dtype


def _config_dtype(folder: Path) -> str | None:
    if not (folder / "config.json").is_file():
        return None
    config = read_hf_config(folder)
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        name = value.removeprefix("torch.") if isinstance(value, str) else None
        if name in _DTYPES:
            return name
    return None


def _weights_dtype(folder: Path) -> str | None:
    for file in sorted(folder.glob("*.safetensors")):
        for info in _safetensors_header(file).values():
            if isinstance(info, dict) and info.get("dtype") in _SAFETENSORS_DTYPES:
                return _SAFETENSORS_DTYPES[info["dtype"]]
    return None


def _safetensors_header(file: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (an 8-byte little-endian length, then the JSON)."""
    try:
        with file.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if not 2 <= size <= 100 << 20:
                raise ValueError(f"header length {size}")
            header = json.loads(handle.read(size))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"dtype {CHECKPOINT_DTYPE!r}: cannot read the header of {file}: {exc}") from exc
    return header if isinstance(header, dict) else {}
