"""The ``vllm.general_plugins`` entry point (`compat.vllm_plugin`) acts only in processes Omni runs
vLLM in: a user's own vLLM process, which merely has omni-qwen3 installed, keeps its modules as
they were. Each case runs in a fresh interpreter, as vLLM's own processes do."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from omni_core.stages.vllm_bridge import OMNI_PROCESS_ENV
from omni_qwen3 import compat

# Prints what the entry point changed: modules added, and whether the alias is in place.
_CALL_PLUGIN = """
import json, sys
from omni_qwen3 import compat
before = set(sys.modules)
compat.vllm_plugin()
alias = sys.modules.get(compat.TORCHVISION_IMAGE_MODULE)
print(json.dumps({"added": sorted(set(sys.modules) - before), "alias": bool(getattr(alias, "__omni_pil_alias__", False))}))
"""

# The same through vLLM's own loader of general plugins (what its processes run).
_LOAD_THROUGH_VLLM = """
import json, sys
from vllm.plugins import load_general_plugins
from omni_qwen3 import compat
load_general_plugins()
alias = sys.modules.get(compat.TORCHVISION_IMAGE_MODULE)
print(json.dumps({"alias": bool(getattr(alias, "__omni_pil_alias__", False))}))
"""


def _run(code: str, *, marked: bool) -> dict:
    # This test process may carry the mark already (an engine started by an earlier test).
    env = {k: v for k, v in os.environ.items() if k != OMNI_PROCESS_ENV}
    if marked:
        env[OMNI_PROCESS_ENV] = "1"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_plugin_leaves_other_processes_untouched() -> None:
    """Without Omni's mark the entry point imports nothing and installs nothing."""
    result = _run(_CALL_PLUGIN, marked=False)
    assert result == {"added": [], "alias": False}


def test_plugin_installs_the_alias_in_omni_processes() -> None:
    """With the mark (a stage process, or vLLM's subprocess of one) it installs the PIL alias."""
    if compat.torchvision_available():
        pytest.skip("torchvision works here: the plugin has nothing to install")
    assert _run(_CALL_PLUGIN, marked=True)["alias"] is True


@pytest.mark.vllm
def test_vllm_loads_the_plugin_only_for_omni() -> None:
    """Through vLLM's own plugin loader (the entry point as installed): a user's process without
    the mark keeps transformers' module name free; a marked one gets the alias."""
    if compat.torchvision_available():
        pytest.skip("torchvision works here: the plugin has nothing to install")
    assert _run(_LOAD_THROUGH_VLLM, marked=False)["alias"] is False
    assert _run(_LOAD_THROUGH_VLLM, marked=True)["alias"] is True
