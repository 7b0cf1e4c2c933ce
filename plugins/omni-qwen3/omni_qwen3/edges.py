"""Edge adapters of the Qwen3-Omni pipeline.

`ThinkerToTalker` turns the thinker's streamed chunks into the talker's input, exactly as
transformers' ``Qwen3OmniMoeForConditionalGeneration.generate`` builds it:

- the talker prompt is the user turns (text rows: ``text_projection`` of the thinker's input
  embeddings; audio/image/video rows: ``hidden_projection`` of the thinker's layer
  ``accept_hidden_layer`` hidden state), then 9 assistant rows (``<|im_start|>assistant\\n``, four
  ``tts_pad``, ``tts_bos`` + the first generated token; plus codec ids nothink, think_bos,
  think_eos, speaker, pad, bos on the last six);
- the trailing text: the thinker's input embeddings of generated tokens 1.. (the rows it fed back)
  then ``tts_eos``'s; the talker's model projects them (``text_projection``, a step's rows of all
  requests in one call) and adds one per step, then ``tts_pad``;
- for image (and video) prompts, the talker's 3-D M-RoPE positions: transformers' ``get_rope_index``
  on the talker's input ids with the thinker's ``image_grid_thw`` (sent in its first chunk).

It streams. Only the prompt's rows come from the thinker's captured rows: a generated token's row
is its thinker input embedding, read from the thinker's token table as soon as the token arrives
(the thinker sends the captured row a step later, when it feeds the token). So the talker's prompt
is whole with the thinker's first chunk (its prefill, which samples the first token), and each
later chunk's tokens become more trailing text (``tts_eos`` with the last; the thinker never feeds
its last token, so that one has no row). The talker runtime holds the talker where its text runs
out.

The speaker's codec embedding is added by the talker's model part (`omni_qwen3.talker`), which
sees the request's parameters; this adapter marks its row. It runs in the talker's worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from omni_core.errors import InvalidRequestError
from omni_core.outputs import Chunk, StageInput
from omni_core.parts import EdgeAdapter, PartContext
from omni_qwen3.talker import ASSISTANT_PREFIX

if TYPE_CHECKING:
    import torch

    from omni_qwen3.talker import TalkerWeights


@attrs.frozen
class TalkerInput:
    """The talker's input for one request (see the module docstring)."""

    prompt_embeds: torch.Tensor  # [P, H], without the speaker's codec embedding
    speaker_row: int
    trailing: torch.Tensor  # [T, H_thinker]: thinker input embeddings, projected by the talker's model
    tts_pad: torch.Tensor  # [H], projected
    input_ids: torch.Tensor  # [P] thinker ids of the user rows, tts_pad for the assistant rows
    mrope_positions: torch.Tensor | None = None  # [3, P] for multimodal (image/video) prompts
    mrope_delta: int = 0


def build_talker_input(
    weights: TalkerWeights,
    prompt_ids: list[int],
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    final: bool = True,
    grids: dict[str, Any] | None = None,
) -> TalkerInput:
    """Talker input from the thinker's prompt ids and its captured rows.

    `embeds` / `hidden` hold one row per token the thinker fed through its model: the prompt, then
    generated tokens (all but the last one once the thinker finished: ``[P + G - 1, H_thinker]``).
    Not `final`: the thinker goes on, and ``trailing`` holds the text rows so far, without
    ``tts_eos`` (unprojected: the talker's model projects them as it reads them). `grids`: the
    thinker's ``image_grid_thw`` / ``video_grid_thw`` / ``audio_feature_lengths``, for the M-RoPE
    positions.
    """
    import torch

    config = weights.config
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
        starts = torch.nonzero((ids[:-1] == config["im_start_token_id"]) & (ids[1:] == config["assistant_token_id"])).flatten()
        if starts.numel() == 0:
            raise InvalidRequestError("the thinker prompt has no assistant turn to speak", param="messages")
        start = int(starts[-1])
        user_rows = torch.empty((int(user.sum()), weights.codec_embedding.shape[1]), dtype=torch.float32)
        user_mm = multimodal[user]
        if user_mm.any():
            user_rows[user_mm] = weights.hidden_projection(hidden[:length][user & multimodal])
        # The user's text rows and the assistant's opening rows: one projection (row-wise, so equal
        # to two).
        user_text = embeds[:length][user & ~multimodal]
        text = weights.text_projection(torch.cat([user_text, embeds[start : start + ASSISTANT_PREFIX + 1]]))
        user_rows[~user_mm] = text[: user_text.shape[0]]
        assistant = text[user_text.shape[0] :]
        tts_bos, tts_pad = weights.tts_rows
        text_part = torch.cat(
            [assistant[:ASSISTANT_PREFIX], tts_pad.expand(4, -1), tts_bos, assistant[ASSISTANT_PREFIX : ASSISTANT_PREFIX + 1]]
        )
        # The first generated token may be missing (it was the last one): slices then agree with
        # transformers', which slices the same short tensor.
        assistant_part = text_part + weights.assistant_codec_rows[: text_part.shape[0]]
        trailing = embeds[start + ASSISTANT_PREFIX + 1 :]
        if final:
            trailing = torch.cat([trailing, weights.thinker_embedding([config["tts_eos_token_id"]])])
        prompt = torch.cat([user_rows, assistant_part])
        input_ids = torch.cat([ids[user], torch.full((assistant_part.shape[0],), config["tts_pad_token_id"])])
    positions, delta = talker_positions(config, input_ids, grids or {})
    return TalkerInput(
        prompt_embeds=prompt,
        speaker_row=user_rows.shape[0] + ASSISTANT_PREFIX + 3,
        trailing=trailing,
        tts_pad=tts_pad[0],
        input_ids=input_ids,
        mrope_positions=positions,
        mrope_delta=delta,
    )


def talker_positions(config: dict[str, Any], input_ids: torch.Tensor, grids: dict[str, Any]) -> tuple[torch.Tensor | None, int]:
    """The talker's 3-D M-RoPE positions ``[3, P]`` and decode delta, as transformers computes them
    (``get_rope_index`` on the talker input ids, with ``use_audio_in_video`` when the thinker's
    prompt interleaved a video with its sound track); ``(None, 0)`` when the prompt has no image or
    video (then positions are plain 0..P-1, which the talker uses by default).

    Audio beside an image or video needs the audio encoder's ``n_window``, which ``get_rope_index``
    reads from ``config.audio_config``: only the thinker's config has one (transformers' talker
    raises AttributeError there), so the talker's config here borrows the thinker's.
    """
    import types

    import torch
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoderConfig,
        Qwen3OmniMoeTalkerConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoePreTrainedModelForConditionalGeneration as Base,
    )

    image = grids.get("image_grid_thw")
    video = grids.get("video_grid_thw")
    if not image and not video:
        return None, 0
    talker_config = Qwen3OmniMoeTalkerConfig(**config["talker_config"])
    if getattr(talker_config, "audio_config", None) is None:
        talker_config.audio_config = Qwen3OmniMoeAudioEncoderConfig(**config["thinker_config"].get("audio_config", {}))
    # get_rope_index reads only these attributes of the talker model.
    holder = types.SimpleNamespace(config=talker_config, spatial_merge_size=talker_config.spatial_merge_size)
    holder.get_llm_pos_ids_for_vision = types.MethodType(Base.get_llm_pos_ids_for_vision, holder)
    audio = grids.get("audio_feature_lengths")
    seconds = grids.get("video_second_per_grid")
    ids = input_ids.view(1, -1)
    positions, delta = Base.get_rope_index(
        holder,
        ids,
        image_grid_thw=torch.as_tensor(image, dtype=torch.long) if image else None,
        video_grid_thw=torch.as_tensor(video, dtype=torch.long) if video else None,
        attention_mask=torch.ones_like(ids),
        use_audio_in_video=bool(grids.get("use_audio_in_video")),
        audio_seqlens=torch.as_tensor(audio, dtype=torch.long) if audio else None,
        second_per_grids=torch.as_tensor(seconds, dtype=torch.float32) if video and seconds is not None else None,
    )
    return positions[:, 0].round().long(), int(delta.view(-1)[0])


class ThinkerToTalker(EdgeAdapter):
    """Edge adapter thinker -> talker: collects the thinker's rows, streams the talker's input.

    The talker's input starts once the thinker's prompt rows and first generated token arrived (or
    the thinker finished); after that every thinker chunk adds its tokens' rows to ``trailing`` (and
    the last one ``tts_eos``). With one final thinker chunk (streaming off) it is one final input.
    """

    def __init__(self, context: PartContext) -> None:
        from omni_qwen3.talker import TalkerWeights

        super().__init__(context)
        # Loaded with the talker's worker, not by its first request (the thinker's embedding table
        # alone is hundreds of MB in the released checkpoint).
        self.weights = TalkerWeights(context.model_path)

    def on_chunk(self, state: dict[str, Any], chunk: Chunk) -> StageInput | None:
        import torch

        data = chunk.data
        if data.get("prompt_token_ids") is not None:
            state["prompt_ids"] = list(data["prompt_token_ids"])
        for key in GRID_KEYS:
            if data.get(key) is not None:
                state.setdefault("grids", {})[key] = data[key]
        state.setdefault("tokens", []).extend(int(t) for t in data.get("token_ids") or ())
        # The thinker feeds every token it generates but its last: those rows exist (or will).
        fed = max(len(state["tokens"]) - (1 if chunk.final else 0), 0)
        if state.get("started"):
            return self._more_text(state, fed, chunk.final)
        for key in ("thinker_embeds", "thinker_hidden"):
            rows = data.get(key)
            if rows is not None:
                state.setdefault(key, []).append(torch.as_tensor(rows))
        if "prompt_ids" not in state or "thinker_embeds" not in state or "thinker_hidden" not in state:
            if not chunk.final:
                return None
            raise InvalidRequestError(
                "the thinker's chunks lack prompt_token_ids / thinker_embeds / thinker_hidden: the talker "
                "needs the thinker to capture them (audio output requested)",
                param="modalities",
            )
        embeds = torch.cat(state.pop("thinker_embeds"))
        hidden = torch.cat(state.pop("thinker_hidden"))
        prompt_len = len(state["prompt_ids"])
        if (embeds.shape[0] < prompt_len or fed == 0) and not chunk.final:
            # The prompt's rows, then its first generated token (its row ends the talker's prompt).
            state["thinker_embeds"], state["thinker_hidden"] = [embeds], [hidden]
            return None
        # A generated token's row is its thinker input embedding: read from the token table, it
        # is there as soon as the token is sampled, a thinker step before the thinker sends it.
        if embeds.shape[0] >= prompt_len:  # (else build_talker_input rejects the short capture)
            embeds = torch.cat([embeds[:prompt_len].to(torch.float32), self.weights.thinker_embedding(state["tokens"][:fed])])
            hidden = hidden[:prompt_len]
        built = build_talker_input(
            self.weights, state["prompt_ids"], embeds, hidden, final=chunk.final, grids=state.get("grids")
        )
        state["started"] = True
        state["sent"] = fed
        out: dict[str, Any] = {
            "prompt_embeds": built.prompt_embeds,
            "speaker_row": built.speaker_row,
            "trailing": built.trailing,
            "tts_pad": built.tts_pad,
        }
        if built.mrope_positions is not None:
            out["mrope_positions"] = built.mrope_positions
            out["mrope_delta"] = built.mrope_delta
        return StageInput(data=out, final=chunk.final)

    def _more_text(self, state: dict[str, Any], fed: int, final: bool) -> StageInput | None:
        """Trailing text rows of the thinker's newly generated tokens (plus tts_eos's at the end)."""
        import torch

        weights = self.weights
        new = state["tokens"][state["sent"] : fed]
        state["sent"] = max(fed, state["sent"])
        rows = [weights.thinker_embedding(new)] if new else []
        if final:
            rows.append(weights.thinker_embedding([weights.config["tts_eos_token_id"]]))
        if not rows:
            return None
        return StageInput(data={"trailing": torch.cat(rows)}, final=final)


GRID_KEYS = ("image_grid_thw", "video_grid_thw", "video_second_per_grid", "audio_feature_lengths", "use_audio_in_video")
"""First-chunk keys of the thinker (`omni_qwen3.thinker.ThinkerModel.prompt_info`) the talker's
positions need."""
