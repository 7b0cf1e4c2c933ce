"""Load vLLM's Qwen3-Omni thinker where torchvision is not installed (CPU machines).

Why this exists: transformers' ``qwen2_vl/image_processing_qwen2_vl.py`` (the torchvision-backed
image processor) imports torchvision at module import, and vLLM's ``qwen2_vl``/``qwen3_vl``/
``qwen3_omni_moe_thinker`` model modules import ``smart_resize`` and ``Qwen2VLImageProcessor``
from it. No CPU build of torchvision exists on PyPI (the CUDA builds fail with
``operator torchvision::nms does not exist``), so without help vLLM cannot even inspect the model.

What it does, only when ``import torchvision`` fails: it puts a module under that import name whose
contents are transformers' PIL twin, ``image_processing_pil_qwen2_vl`` (same ``smart_resize``, and
``Qwen2VLImageProcessor`` = ``Qwen2VLImageProcessorPil``, which gives the same pixel values for
the images we feed it). Nothing of transformers or vLLM is modified; the alias only fills a module
name that could not be imported at all. Video processors stay unavailable: video input is rejected
by the input processor with a clear error.

Where it runs: `install()` is called by the thinker's model part before vLLM imports the model
class, and by vLLM itself through the ``vllm.general_plugins`` entry point (`vllm_plugin`), which
covers vLLM's model-inspection subprocess. vLLM runs that entry point in every process where it
loads plugins, a user's own vLLM process too; there it does nothing: the alias is installed only
in processes Omni runs vLLM in, or that were started from one
(`omni_core.stages.vllm_bridge.omni_started_process`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

from omni_core.stages.vllm_bridge import omni_started_process

TORCHVISION_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def torchvision_available() -> bool:
    """Whether torchvision imports (a broken CUDA build counts as absent)."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        importlib.import_module("torchvision")
    except Exception:  # the CUDA wheels raise RuntimeError/ImportError on CPU-only torch
        return False
    return True


def install() -> bool:
    """Serve the torchvision image-processor module from its PIL twin if torchvision is absent.

    Idempotent; returns True when the alias is in place (now or from an earlier call), False when
    torchvision works and nothing was needed.
    """
    current = sys.modules.get(TORCHVISION_IMAGE_MODULE)
    if current is not None and getattr(current, "__omni_pil_alias__", False):
        return True
    if torchvision_available():
        return False
    pil = importlib.import_module(PIL_IMAGE_MODULE)
    alias = types.ModuleType(TORCHVISION_IMAGE_MODULE, doc=f"{PIL_IMAGE_MODULE} served under this name (omni_qwen3.compat)")
    alias.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
    alias.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
    alias.__omni_pil_alias__ = True  # type: ignore[attr-defined]
    alias.__all__ = [k for k in vars(alias) if not k.startswith("_")]  # type: ignore[attr-defined]
    sys.modules[TORCHVISION_IMAGE_MODULE] = alias
    return True


def vllm_plugin() -> None:
    """vLLM ``general_plugins`` entry point: runs in every vLLM process before models load.

    Installs the alias (`install`) only in processes Omni runs vLLM in (and their children, such
    as vLLM's inspection subprocess); any other process is left as it was.
    """
    if omni_started_process():
        install()
