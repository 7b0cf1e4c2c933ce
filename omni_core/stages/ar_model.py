"""The model part of an `ar` stage: what a model plugin supplies to `ARStageRuntime`.

A stage's `model` is a ``"module:attr"`` reference to a factory ``(PartContext) -> ARModel``
(`omni_core.parts`): usually an `ARModel` subclass. The defaults make the simplest model part "this
checkpoint directory, as vLLM loads it": the reference ``"omni_core.stages.ar_model:ARModel"``.
Plugins customise by subclassing: overriding the declarations (class attributes) and methods
(`register`, `engine_args`, `make_prompt`, `sampling_params`, `chunk_data`). Nothing here imports
vLLM at module import.
"""

from __future__ import annotations

import os
import types
from typing import TYPE_CHECKING, Any, Mapping

import attrs

from omni_core.errors import InvalidRequestError
from omni_core.outputs import Payload, StageInput
from omni_core.parts import Part

if TYPE_CHECKING:
    import torch
    from vllm import SamplingParams


@attrs.define
class ARDelta:
    """What one engine step produced for one request, before `ARModel.chunk_data` shapes it.

    `prompt_token_ids` is set on the first delta only; `finish_reason` on the last one.
    `hidden_states` ([n_rows, hidden]) holds the captured rows not delivered yet, when capture is on
    (the first captured layer); `layer_states` holds them for every key of
    `ARModel.capture_layers` (chunk keys -> rows).
    """

    request_id: str
    token_ids: list[int]
    text: str
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    hidden_states: torch.Tensor | None = None
    logprobs: Any = None
    layer_states: dict[str, torch.Tensor] | None = None
    prompt_info: Payload | None = None  # `ARModel.prompt_info`, on the first delta only


class ARModel(Part):
    """The model part of an `ar` stage.

    Declarations (class attributes; a subclass overrides them, or sets them on the instance in
    its ``__init__`` when they depend on the checkpoint):

    - `subfolder`: the LM lives in this subfolder of the pipeline's checkpoint.
    - `model_path`: an explicit path instead (wins over `subfolder`).
    - `tokenizer`, `skip_tokenizer_init`, `hf_overrides`, `enable_prompt_embeds`: as vLLM's
      `EngineArgs`; `engine_overrides` carries any other `EngineArgs` the model needs.
    - `architectures`: out-of-tree vLLM model classes to register (``arch -> "module:Class"``).
    - `capture_hidden_states`: attach per-token hidden states (``hidden_states``, [n, hidden], for
      prompt and generated tokens as they pass through the model) to each chunk. The registered
      model class must mix in `vllm_bridge.HiddenStateCapture`; with `capture_base` (a vLLM model
      class ``"module:Class"``) such a class is made and registered for you.
    - `hidden_state_layer`: None = final normed hidden state; k = after decoder layer k (0: embeddings).
    - `hidden_state_layers`: several layers at once, ``chunk key -> layer`` (same meaning as
      `hidden_state_layer`); each key becomes a chunk key with its ``[n, hidden]`` rows. Empty: the
      one layer `hidden_state_layer` under ``hidden_states``.
    - `streamed_input`: the request starts before its input is final and takes more input while
      it runs (`extend_request`). It may generate `token_budget` tokens with the input it has; at
      the budget the runtime takes it out of vLLM (no engine step waits for it) and resumes it with
      `continuation_prompt` once more input raises the budget. `side_inputs` (per request, updated
      as input streams in) reach the vLLM model class through the bridge's side-input store.
      Without it (the default) streamed input is buffered until final, then the request starts.
    - `resumable` (with `streamed_input`): a request started before its input is final runs as a
      vLLM streaming-input session instead: at its budget it stays in vLLM, out of the batch, with
      its KV cache, and resumes by feeding only its last sampled token (no re-prefill). It then
      starts as soon as its input allows one token, so its prompt is prefilled while more input
      streams in. Its prompts must be token ids (`make_prompt`); a model class that needs
      embeddings puts them in from its side inputs.
    - `request_params`: per-request parameters the model takes besides vLLM's sampling parameters
      (a `sampling_params` override takes them out); the engine refuses any other parameter
      before the request starts, even where the stage runs after others.
    - `media_params`: those of `request_params` that carry a medium as a URL (as
      `DiffusionModel.media_params`).
    - `load_options`: the stage options the model part applies; the default, ``quantization``,
      holds when the registered vLLM model class builds its layers from vLLM's quantization config
      (vLLM's own classes do); a class of plain torch modules declares none, and `resolve()`
      refuses the option.

    The base class as it is serves "this checkpoint directory, as vLLM loads it": a stage whose
    ``model`` is ``"omni_core.stages.ar_model:ARModel"`` needs no code of its own.
    """

    subfolder: str | None = None
    model_path: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    enable_prompt_embeds: bool = False
    hf_overrides: Mapping[str, Any] = types.MappingProxyType({})
    engine_overrides: Mapping[str, Any] = types.MappingProxyType({})
    architectures: Mapping[str, str] = types.MappingProxyType({})
    capture_hidden_states: bool = False
    hidden_state_layer: int | None = None
    capture_base: str | None = None
    hidden_state_layers: Mapping[str, int | None] = types.MappingProxyType({})
    streamed_input: bool = False
    resumable: bool = False
    request_params: frozenset[str] = frozenset()
    media_params: frozenset[str] = frozenset()
    load_options: frozenset[str] = frozenset({"quantization"})

    @property
    def capture_layers(self) -> dict[str, int | None]:
        """Chunk key -> captured layer, in the order the rows are recorded."""
        return dict(self.hidden_state_layers) or {"hidden_states": self.hidden_state_layer}

    def wants_hidden_states(self, stage_input: StageInput) -> bool:
        """Whether this request's chunks carry the captured rows (when capture is on at all).

        The model records rows for every request in the batch either way; a model part may drop
        them for requests that do not need them (e.g. no downstream stage reads them).
        """
        return True

    @property
    def capture_architecture(self) -> str | None:
        """The architecture name registered for `capture_base`, if any."""
        if not (self.capture_hidden_states and self.capture_base):
            return None
        return "OmniCapture" + self.capture_base.rpartition(":")[2]

    def register(self) -> None:
        """Register out-of-tree vLLM model classes; called in the worker before the engine starts."""
        from omni_core.stages import vllm_bridge

        classes: dict[str, str | type] = dict(self.architectures)
        if self.capture_architecture and self.capture_base:
            classes[self.capture_architecture] = vllm_bridge.capture_model_class(self.capture_base)
        vllm_bridge.register_architectures(classes)

    def engine_args(self) -> dict[str, Any]:
        """`EngineArgs` keywords this model needs (the runtime adds its deploy options)."""
        path = self.model_path or self.context.model_path
        if self.subfolder and not self.model_path:
            path = os.path.join(path, self.subfolder)
        args: dict[str, Any] = {"model": path, **self.engine_overrides}
        if self.tokenizer:
            args["tokenizer"] = self.tokenizer
        if self.skip_tokenizer_init:
            args["skip_tokenizer_init"] = True
        if self.enable_prompt_embeds:
            args["enable_prompt_embeds"] = True
        overrides = dict(self.hf_overrides)
        if self.capture_architecture:
            overrides["architectures"] = [self.capture_architecture]
        if overrides:
            args["hf_overrides"] = overrides
        if self.capture_hidden_states:
            from omni_core.stages.vllm_bridge import CaptureSettings

            additional = dict(args.get("additional_config") or {})
            settings = CaptureSettings(layers=tuple(self.capture_layers.values()))
            additional.update(settings.to_additional_config())
            args["additional_config"] = additional
        return args

    def merge_input(self, previous: Payload, more: Payload) -> Payload:
        """Join streamed input (non-final `StageInput`s) before the request starts.

        Lists (``prompt_token_ids``) and strings (``prompt``) concatenate, tensors
        (``prompt_embeds``) concatenate along the token axis; other keys: the later value wins.
        """
        merged = dict(previous)
        for key, value in more.items():
            old = merged.get(key)
            if old is None:
                merged[key] = value
            elif isinstance(old, (list, str)) and type(old) is type(value):
                merged[key] = old + value
            elif hasattr(old, "shape") and hasattr(value, "shape"):
                import torch

                merged[key] = torch.cat([torch.as_tensor(old), torch.as_tensor(value)], dim=0)
            else:
                merged[key] = value
        return merged

    def make_prompt(self, stage_input: StageInput) -> dict[str, Any]:
        """Turn stage input into a vLLM prompt (a `TextPrompt`/`TokensPrompt`/`EmbedsPrompt` dict).

        Accepts ``prompt`` (text), ``prompt_token_ids``, ``prompt_embeds`` ([n, hidden] tensor, needs
        `enable_prompt_embeds`), ``multi_modal_data`` and ``mm_processor_kwargs`` (for vLLM's
        multimodal processor).
        """
        data = stage_input.data
        prompt: dict[str, Any]
        if data.get("prompt_embeds") is not None:
            import torch

            prompt = {"prompt_embeds": torch.as_tensor(data["prompt_embeds"])}
        elif data.get("prompt_token_ids") is not None:
            ids = data["prompt_token_ids"]
            prompt = {"prompt_token_ids": [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]}
        elif isinstance(data.get("prompt"), str):
            prompt = {"prompt": data["prompt"]}
        else:
            raise InvalidRequestError(
                "an 'ar' stage needs 'prompt' (text), 'prompt_token_ids' or 'prompt_embeds' in its "
                f"input; got keys {sorted(data)}",
                param="prompt",
            )
        if data.get("multi_modal_data"):
            prompt["multi_modal_data"] = data["multi_modal_data"]
            if data.get("mm_processor_kwargs"):
                prompt["mm_processor_kwargs"] = dict(data["mm_processor_kwargs"])
        return prompt

    def chat_prompt(self, messages: list[dict[str, Any]], tokenizer: Any) -> Payload:
        """Chat messages (OpenAI format) -> ``{"prompt_token_ids": [...]}`` via the chat template.

        Text content only (a string, or ``text`` parts joined): a stage whose LM takes images or
        audio overrides this or gets its input from the family's input processor instead.
        """
        rendered = []
        for i, message in enumerate(messages):
            content = message.get("content")
            if isinstance(content, list):
                kinds = sorted({str(part.get("type")) for part in content if part.get("type") != "text"})
                if kinds:
                    raise InvalidRequestError(
                        f"this model's language stage takes text only; content part type(s) {', '.join(kinds)} "
                        "are not supported: send text parts or a string",
                        param=f"messages.{i}.content",
                    )
                content = "".join(str(part.get("text", "")) for part in content)
            rendered.append({**message, "content": content or ""})
        try:
            text = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
        except ValueError as exc:  # no chat template in the checkpoint
            raise InvalidRequestError(f"cannot apply the chat template: {exc}; send a plain prompt instead", param="messages") from exc
        # The template already holds any special tokens; adding them again would change the prompt.
        return {"prompt_token_ids": list(tokenizer.encode(text, add_special_tokens=False))}

    def prompt_info(self, stage_input: StageInput) -> Payload:
        """Keys added to a request's first chunk, about its prompt (e.g. multimodal grid sizes a
        downstream stage needs); computed when the request starts. Default: none."""
        return {}

    # --- streamed input (`streamed_input`) ----------------------------------------------------

    def token_budget(self, data: Payload, final: bool) -> int | None:
        """How many tokens the request may generate in total with the input it has so far
        (`final`: no more input will come); None: no limit from the input."""
        return None

    def side_inputs(self, data: Payload, params: dict[str, Any], final: bool) -> dict[str, Any] | None:
        """Per-request inputs the vLLM model class reads while the request runs (written to the
        bridge's side-input store when it starts and after each streamed input); None: none."""
        return None

    def continuation_prompt(self, stage_input: StageInput, prompt_token_ids: list[int], generated: list[int]) -> dict[str, Any]:
        """The vLLM prompt that resumes a request held at its token budget: the prompt followed by
        every token generated so far (the last one not yet fed through the model). The runtime salts
        every run of a request alike, so a resumed run reads its own earlier runs' blocks from vLLM's
        prefix cache and never another request's."""
        data = stage_input.data
        if data.get("prompt_embeds") is not None or data.get("multi_modal_data"):
            raise NotImplementedError(
                f"{type(self).__name__} must override continuation_prompt to resume an embeddings or multimodal prompt"
            )
        return {"prompt_token_ids": [*prompt_token_ids, *generated]}

    def sampling_params(self, params: dict[str, Any], *, delta: bool = True) -> SamplingParams:
        """Merged per-request parameters -> vLLM `SamplingParams`; unknown keys are rejected."""
        from omni_core.stages.vllm_sampling import build_sampling_params

        return build_sampling_params(params, delta=delta)

    def chunk_data(self, delta: ARDelta) -> Payload:
        """What a chunk of this stage carries: `token_ids`, `text`, and once `prompt_token_ids`,
        at the end `finish_reason`, plus the captured rows under the `capture_layers` keys
        (``hidden_states`` by default)."""
        data: Payload = {"token_ids": list(delta.token_ids), "text": delta.text}
        if delta.prompt_token_ids is not None:
            data["prompt_token_ids"] = list(delta.prompt_token_ids)
        if delta.prompt_info:
            data.update(delta.prompt_info)
        if delta.finish_reason is not None:
            data["finish_reason"] = delta.finish_reason
            if delta.stop_reason is not None:
                data["stop_reason"] = delta.stop_reason
        if delta.layer_states is not None:
            data.update(delta.layer_states)
        elif delta.hidden_states is not None:
            data["hidden_states"] = delta.hidden_states
        if delta.logprobs is not None:
            data["logprobs"] = delta.logprobs
        return data
