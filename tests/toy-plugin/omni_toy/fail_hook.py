"""The toy model parts' test hook: the stage parameter ``fail`` makes a request fail on purpose.

- ``"invalid"``: rejected when it starts (`InvalidRequestError` from ``add_request``);
- ``"request"``: only this request fails, rejected by the model's per-item check at its first
  decode (an error chunk, still a client error);
- ``"stage"``: the decode raises (a stage failure: every request of the stage fails);
- ``"crash"``: the worker process ends (``os._exit(1)``), as a real crash would.
"""

from __future__ import annotations

import os
from typing import Any

from omni_core.errors import InvalidRequestError
from omni_core.stages.generation_model import DecodeBatch, DecodeItem

FAIL_MODES = ("invalid", "request", "stage", "crash")
PARAMS = frozenset({"fail"})  # the request parameters of a model part using this hook


def check_params(params: dict[str, Any]) -> None:
    mode = params.get("fail")
    if mode is not None and mode not in FAIL_MODES:
        raise InvalidRequestError(f"fail must be one of {FAIL_MODES}, got {mode!r}", param="fail")
    if mode == "invalid":
        raise InvalidRequestError("request rejected on purpose (test hook fail='invalid')", param="fail")


def check_item(item: DecodeItem) -> None:
    if item.params.get("fail") == "request":
        raise InvalidRequestError("request failed on purpose (test hook fail='request')", param="fail")


def before_decode(batch: DecodeBatch) -> None:
    modes = {item.params.get("fail") for item in batch.items}
    if "crash" in modes:
        os._exit(1)  # the engine's tests need a real process crash, not an exception
    if "stage" in modes:
        raise RuntimeError("stage failed on purpose (test hook fail='stage')")
