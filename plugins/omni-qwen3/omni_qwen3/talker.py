"""The model part of the Qwen3-Omni ``talker`` stage (kind ``ar``): codec frames on vLLM.

The vLLM model class is `omni_qwen3.talker_model.Qwen3OmniTalkerForCausalLM`. This module says
how the `ar` runtime starts it (the talker slice of the one checkpoint, no tokenizer), turns the
edge adapter's input into a placeholder-id prompt plus per-request side inputs (the prompt's rows,
the speaker, trailing text streamed in while the request runs), how many frames the text so far
allows, and shapes chunks as ``codes`` ``[n_frames, num_code_groups]``.
Also here: `TalkerWeights`, the few small talker tensors the thinker -> talker edge needs.
Nothing heavy is imported at module import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_core.errors import ConfigError, InvalidRequestError
from omni_core.outputs import Payload, StageInput
from omni_core.parts import PartContext
from omni_core.stages.ar_model import ARDelta, ARModel

if TYPE_CHECKING:
    import torch
    from vllm import SamplingParams

DEFAULT_SPEAKER = "Ethan"
# Request parameters of the talker that are not vLLM sampling parameters.
SPEAKER_PARAM = "speaker"
# Codec ids generate() suppresses: the last 1024 of the talker vocabulary, except codec EOS.
SUPPRESSED_TAIL = 1024
# The assistant turn's opening tokens in the talker prompt: <|im_start|> assistant \n.
ASSISTANT_PREFIX = 3


def read_config(model_path: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json as a dict."""
    path = Path(model_path) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the Qwen3-Omni config {path}: {exc}; point the model at a checkpoint directory") from exc


def read_tensors(model_path: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Read a few named tensors from the checkpoint's safetensors files (sharded or not)."""
    from safetensors import safe_open

    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = {name: weight_map.get(name) for name in names}
    else:
        files = {name: "model.safetensors" for name in names}
    missing = sorted(name for name, file in files.items() if file is None)
    if missing:
        raise ConfigError(f"checkpoint {root} lacks tensors {missing}: is it a full Qwen3-Omni checkpoint?")
    out: dict[str, torch.Tensor] = {}
    for file in sorted({f for f in files.values() if f}):
        with safe_open(str(root / file), "pt") as handle:
            for name, owner in files.items():
                if owner == file:
                    out[name] = handle.get_tensor(name)
    return out


def speaker_id(config: dict[str, Any], speaker: str) -> int:
    """The codec id of a speaker name (case-insensitive); `InvalidRequestError` names the choices."""
    speakers: dict[str, int] = config["talker_config"].get("speaker_id") or {}
    found = speakers.get(str(speaker).lower())
    if found is None:
        raise InvalidRequestError(
            f"unknown speaker {speaker!r}; this checkpoint has {sorted(speakers)}", param=SPEAKER_PARAM
        )
    return int(found)


class TalkerWeights:
    """The talker's small input modules, loaded once from the checkpoint (float32, CPU).

    `text_projection` / `hidden_projection` map thinker rows to the talker's width; `codec_embedding`
    is the talker's codec table; `thinker_embedding(ids)` reads rows of the thinker's token table
    (the tts special tokens are embedded with it before projection). `tts_rows` and
    `assistant_codec_rows` are the parts every talker prompt shares, computed once here.
    """

    def __init__(self, model_path: str | Path) -> None:
        import torch
        from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTalkerConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeTalkerResizeMLP

        self.config = read_config(model_path)
        talker_config = Qwen3OmniMoeTalkerConfig(**self.config["talker_config"])
        names = [
            f"talker.{module}.{layer}.{kind}"
            for module in ("text_projection", "hidden_projection")
            for layer in ("linear_fc1", "linear_fc2")
            for kind in ("weight", "bias")
        ]
        names += ["talker.model.codec_embedding.weight", "thinker.model.embed_tokens.weight"]
        tensors = {name: t.to(torch.float32) for name, t in read_tensors(model_path, names).items()}
        self.text_projection = Qwen3OmniMoeTalkerResizeMLP(talker_config).to(torch.float32).eval()
        self.hidden_projection = Qwen3OmniMoeTalkerResizeMLP(talker_config).to(torch.float32).eval()
        for name, module in (("text_projection", self.text_projection), ("hidden_projection", self.hidden_projection)):
            module.load_state_dict({k[len(f"talker.{name}.") :]: v for k, v in tensors.items() if k.startswith(f"talker.{name}.")})
        self.codec_embedding = tensors["talker.model.codec_embedding.weight"]
        self._thinker_embedding = tensors["thinker.model.embed_tokens.weight"]

        talker = self.config["talker_config"]
        with torch.inference_mode():
            special = self.text_projection(self.thinker_embedding([self.config["tts_bos_token_id"], self.config["tts_pad_token_id"]]))
        # tts_bos, tts_pad projected ([1, H] each): in every talker prompt.
        self.tts_rows: tuple[torch.Tensor, torch.Tensor] = (special[0:1], special[1:2])
        # The codec embeddings added to the assistant's 9 opening rows (zero on the first three and
        # on the speaker's row: the talker's model part adds the request's speaker).
        codec_ids = [
            talker["codec_nothink_id"],
            talker["codec_think_bos_id"],
            talker["codec_think_eos_id"],
            None,
            talker["codec_pad_id"],
            talker["codec_bos_id"],
        ]
        rows = torch.zeros((ASSISTANT_PREFIX + len(codec_ids), self.codec_embedding.shape[1]), dtype=torch.float32)
        for offset, codec_id in enumerate(codec_ids):
            if codec_id is not None:
                rows[ASSISTANT_PREFIX + offset] = self.codec_embedding[codec_id]
        self.assistant_codec_rows = rows

    def thinker_embedding(self, ids: list[int]) -> torch.Tensor:
        import torch

        return self._thinker_embedding[torch.as_tensor(ids, dtype=torch.long)]


class TalkerModel(ARModel):
    """The talker stage's `ARModel`: prompt rows and streamed trailing text, ``codes`` chunks.

    Its input (from `omni_qwen3.edges.ThinkerToTalker`): first ``prompt_embeds`` ``[P, H]`` without
    the speaker's codec embedding, ``speaker_row`` (where it goes), ``tts_pad`` ``[H]``, optional
    ``mrope_positions`` ``[3, P]`` / ``mrope_delta``, and ``trailing`` ``[T, H_thinker]`` (the
    text rows so far, unprojected: the model class projects them); then more ``trailing`` rows as
    the thinker streams, ending with ``tts_eos``'s in the final input. Step j feeds trailing row
    j, so with T rows and more to come the request may sample T + 1 codec tokens
    (`token_budget`); the runtime holds it there until more text comes. It is `resumable`: a held
    request stays in vLLM with its KV cache, so its prompt is prefilled as soon as the thinker's
    first chunk arrives, while the thinker goes on. vLLM gets placeholder ids; the prompt's rows
    and the speaker (the ``speaker`` parameter) reach the model class as side inputs.
    """

    skip_tokenizer_init = True
    enable_prompt_embeds = True
    capture_hidden_states = True
    streamed_input = True
    resumable = True
    request_params = frozenset({SPEAKER_PARAM})

    def __init__(self, context: PartContext) -> None:
        super().__init__(context)
        self._config = read_config(context.model_path)

    def register(self) -> None:
        from omni_core.stages import vllm_bridge
        from omni_qwen3.talker_model import ARCHITECTURE

        vllm_bridge.register_architectures({ARCHITECTURE: "omni_qwen3.talker_model:Qwen3OmniTalkerForCausalLM"})

    def engine_args(self) -> dict[str, Any]:
        from omni_qwen3.talker_model import talker_hf_config

        args = super().engine_args()
        # A callable: the talker is a sub-config of the one checkpoint's config.
        args["hf_overrides"] = talker_hf_config
        return args

    def config(self) -> dict[str, Any]:
        """The checkpoint's config.json."""
        return self._config

    def make_prompt(self, stage_input: StageInput) -> dict[str, Any]:
        """Placeholder token ids, one per prompt row: the model class puts in the rows of
        ``prompt_embeds`` and the speaker's codec embedding from the side inputs, as vLLM keeps no
        embeddings prompt across the turns of a resumable request."""
        rows = int(self._prompt_rows(stage_input.data).shape[0])
        return {"prompt_token_ids": [int(self.config()["talker_config"]["codec_pad_id"])] * rows}

    @staticmethod
    def _prompt_rows(data: Payload) -> Any:
        embeds = data.get("prompt_embeds")
        if embeds is None:
            raise InvalidRequestError(
                "the talker stage takes 'prompt_embeds' from the thinker -> talker edge adapter "
                f"(omni_qwen3.edges:ThinkerToTalker); got keys {sorted(data)}",
                param="prompt_embeds",
            )
        return embeds

    def token_budget(self, data: Payload, final: bool) -> int | None:
        if final:
            return None  # the text is complete: tts_pad after its end, as transformers does
        trailing = data.get("trailing")
        return (0 if trailing is None else int(trailing.shape[0])) + 1

    def side_inputs(self, data: Payload, params: dict[str, Any], final: bool) -> dict[str, Any] | None:
        import torch

        side: dict[str, Any] = {"text_final": final, "prompt_embeds": torch.as_tensor(self._prompt_rows(data))}
        if data.get("speaker_row") is not None:
            side["speaker_row"] = int(data["speaker_row"])
            side["speaker_id"] = speaker_id(self.config(), params.get(SPEAKER_PARAM) or DEFAULT_SPEAKER)
        for key in ("trailing", "tts_pad", "mrope_positions", "mrope_delta"):
            if data.get(key) is not None:
                side[key] = data[key]
        if side.get("trailing") is None:
            side["trailing"] = torch.zeros((0, int(self.config()["talker_config"]["thinker_hidden_size"])))
        return side

    def continuation_prompt(self, stage_input: StageInput, prompt_token_ids: list[int], generated: list[int]) -> dict[str, Any]:
        """The first prompt plus the generated tokens: the model class puts in the prompt's rows
        and the frames' embeddings (its side inputs say which tokens they are)."""
        return {"prompt_token_ids": [*self.make_prompt(stage_input)["prompt_token_ids"], *generated]}

    def sampling_params(self, params: dict[str, Any], *, delta: bool = True) -> SamplingParams:
        from omni_core.stages.vllm_sampling import build_sampling_params

        params = dict(params)
        speaker = params.pop(SPEAKER_PARAM, None)
        talker = self._config["talker_config"]
        if speaker is not None:
            speaker_id(self._config, speaker)  # reject an unknown speaker before anything starts
        eos = int(talker["codec_eos_token_id"])
        vocab = int(talker["text_config"]["vocab_size"])
        params["stop_token_ids"] = sorted({eos, *(params.get("stop_token_ids") or [])})
        if params.get("allowed_token_ids") is None:
            params["allowed_token_ids"] = [*range(vocab - SUPPRESSED_TAIL), eos]
        return build_sampling_params(params, delta=delta)

    def chunk_data(self, delta: ARDelta) -> Payload:
        """``codes`` ``[n_frames, num_code_groups]`` (int64) per step, and the finish reason."""
        import torch

        data: Payload = {}
        rows = delta.hidden_states
        if rows is not None and rows.numel():
            codes = rows[rows[:, 0] >= 0]
        else:
            groups = int(self.config()["talker_config"]["num_code_groups"])
            codes = torch.zeros((0, groups), dtype=torch.long)
        data["codes"] = codes
        if delta.finish_reason is not None:
            data["finish_reason"] = delta.finish_reason
        return data

