"""Edge adapters of the Qwen3-Omni pipeline.

`ThinkerToTalker` turns the thinker's streamed chunks into the talker's input, exactly as
transformers' ``Qwen3OmniMoeForConditionalGeneration.generate`` builds it:

- the talker prompt is the user turns (text rows: ``text_projection`` of the thinker's input
  embeddings; audio/image/video rows: ``hidden_projection`` of the thinker's layer
  ``accept_hidden_layer`` hidden state), then 9 assistant rows (``<|im_start|>assistant\\n``, four
  ``tts_pad``, ``tts_bos`` + the first generated token; plus codec ids nothink, think_bos,
  think_eos, speaker, pad, bos on the last six);
- the trailing text: projected embeddings of generated tokens 1.. (the rows the thinker fed back)
  then ``tts_eos``; the talker adds one per step, then ``tts_pad``.

The speaker's codec embedding is added by the talker's model part (`omni_qwen3.talker`), which
sees the request's parameters; this adapter marks its row. It runs in the talker's worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from omni_core.errors import InvalidRequestError
from omni_core.outputs import Chunk, StageInput

if TYPE_CHECKING:
    import torch

    from omni_core.config.resolved import ResolvedEdge, ResolvedPipeline
    from omni_qwen3.talker import TalkerWeights

ASSISTANT_PREFIX = 3  # <|im_start|> assistant \n


@attrs.frozen
class TalkerInput:
    """The talker's input for one request (see the module docstring)."""

    prompt_embeds: torch.Tensor  # [P, H], without the speaker's codec embedding
    speaker_row: int
    trailing: torch.Tensor  # [T, H]
    tts_pad: torch.Tensor  # [H]
    input_ids: torch.Tensor  # [P] thinker ids of the user rows, tts_pad for the assistant rows


def build_talker_input(
    weights: TalkerWeights,
    prompt_ids: list[int],
    embeds: torch.Tensor,
    hidden: torch.Tensor,
) -> TalkerInput:
    """Talker input from the thinker's prompt ids and its captured rows.

    `embeds` / `hidden` hold one row per token the thinker fed through its model: the prompt, then
    each generated token but the last (``[P + G - 1, H_thinker]``).
    """
    import torch

    config = weights.config
    talker = config["talker_config"]
    thinker = config["thinker_config"]
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    length = ids.shape[0]
    if embeds.shape[0] < length or hidden.shape[0] < length:
        raise InvalidRequestError(
            f"the thinker sent {embeds.shape[0]} embedding rows for a {length}-token prompt: it must capture "
            "thinker_embeds/thinker_hidden for every prompt row when audio output is requested",
            param="modalities",
        )
    embeds = embeds.to(torch.float32)
    hidden = hidden.to(torch.float32)
    with torch.inference_mode():
        # User turns: tokens whose latest <|im_start|> opens a user turn.
        positions = torch.arange(length)
        im_start = torch.where(ids == config["im_start_token_id"], positions, torch.full_like(positions, -1))
        previous = torch.cummax(im_start, dim=0).values.clamp_min(0)
        roles = ids[(previous + 1).clamp_max(length - 1)]
        user = roles == config["user_token_id"]
        multimodal = (ids == thinker["audio_token_id"]) | (ids == thinker["image_token_id"]) | (ids == thinker["video_token_id"])
        user_rows = torch.empty((int(user.sum()), weights.codec_embedding.shape[1]), dtype=torch.float32)
        user_mm = multimodal[user]
        if user_mm.any():
            user_rows[user_mm] = weights.hidden_projection(hidden[:length][user & multimodal])
        user_rows[~user_mm] = weights.text_projection(embeds[:length][user & ~multimodal])

        starts = torch.nonzero((ids[:-1] == config["im_start_token_id"]) & (ids[1:] == config["assistant_token_id"])).flatten()
        if starts.numel() == 0:
            raise InvalidRequestError("the thinker prompt has no assistant turn to speak", param="messages")
        assistant = weights.text_projection(embeds[int(starts[-1]) :])
        special = weights.text_projection(
            weights.thinker_embedding([config["tts_bos_token_id"], config["tts_eos_token_id"], config["tts_pad_token_id"]])
        )
        tts_bos, tts_eos, tts_pad = special[0:1], special[1:2], special[2:3]
        text_part = torch.cat(
            [assistant[:ASSISTANT_PREFIX], tts_pad.expand(4, -1), tts_bos, assistant[ASSISTANT_PREFIX : ASSISTANT_PREFIX + 1]]
        )
        codec_ids = [
            talker["codec_nothink_id"],
            talker["codec_think_bos_id"],
            talker["codec_think_eos_id"],
            None,  # the speaker: added by the talker's model part
            talker["codec_pad_id"],
            talker["codec_bos_id"],
        ]
        codec_part = torch.zeros((ASSISTANT_PREFIX + len(codec_ids), text_part.shape[1]), dtype=torch.float32)
        for offset, codec_id in enumerate(codec_ids):
            if codec_id is not None:
                codec_part[ASSISTANT_PREFIX + offset] = weights.codec_embedding[codec_id]
        # The first generated token may be missing (it was the last one): slices then agree with
        # transformers', which slices the same short tensor.
        assistant_part = text_part + codec_part[: text_part.shape[0]]
        trailing = torch.cat([assistant[ASSISTANT_PREFIX + 1 :], tts_eos])
        prompt = torch.cat([user_rows, assistant_part])
        input_ids = torch.cat([ids[user], torch.full((assistant_part.shape[0],), config["tts_pad_token_id"])])
    return TalkerInput(
        prompt_embeds=prompt,
        speaker_row=user_rows.shape[0] + ASSISTANT_PREFIX + 3,
        trailing=trailing,
        tts_pad=tts_pad[0],
        input_ids=input_ids,
    )


class ThinkerToTalker:
    """Edge adapter thinker -> talker: collects the thinker's rows, emits the talker's input.

    The talker starts when the thinker's last chunk arrives (its prompt needs only the first
    generated token, but its per-step text must match transformers' exactly, which this version
    guarantees by building it from the whole thinker output).
    """

    def __init__(self, pipeline: ResolvedPipeline, edge: ResolvedEdge | None = None) -> None:
        self.model_path = pipeline.model_path
        self._weights: TalkerWeights | None = None

    def weights(self) -> TalkerWeights:
        if self._weights is None:
            from omni_qwen3.talker import TalkerWeights

            self._weights = TalkerWeights(self.model_path)
        return self._weights

    def on_chunk(self, state: dict[str, Any], chunk: Chunk) -> StageInput | None:
        import torch

        data = chunk.data
        if data.get("prompt_token_ids") is not None:
            state["prompt_ids"] = list(data["prompt_token_ids"])
        for key in ("thinker_embeds", "thinker_hidden"):
            rows = data.get(key)
            if rows is not None:
                state.setdefault(key, []).append(torch.as_tensor(rows))
        if not chunk.final:
            return None
        if "prompt_ids" not in state or "thinker_embeds" not in state or "thinker_hidden" not in state:
            raise InvalidRequestError(
                "the thinker's chunks lack prompt_token_ids / thinker_embeds / thinker_hidden: the talker "
                "needs the thinker to capture them (audio output requested)",
                param="modalities",
            )
        built = build_talker_input(
            self.weights(),
            state["prompt_ids"],
            torch.cat(state.pop("thinker_embeds")),
            torch.cat(state.pop("thinker_hidden")),
        )
        from omni_qwen3.talker import SIDE_INPUTS_PARAM

        side: dict[str, Any] = {"trailing": built.trailing, "tts_pad": built.tts_pad}
        return StageInput(
            data={"prompt_embeds": built.prompt_embeds, "speaker_row": built.speaker_row},
            final=True,
            params={SIDE_INPUTS_PARAM: side},
        )
