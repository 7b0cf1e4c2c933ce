"""The Qwen3-Omni Talker as a vLLM model class (registered out of tree by `omni_qwen3.talker`).

vLLM's own `Qwen3MoeForCausalLM` is the talker's language model (shared expert and router map
natively): `talker.model.codec_embedding` is its `embed_tokens`, `talker.codec_head` its `lm_head`.
vLLM samples codebook 0; this class adds what a codec frame needs on top, inside `forward`:

- For every generated codebook-0 token fed back (a decode row), the code predictor turns the
  previous step's final hidden state and that token's embedding into codebooks 1..N-1, decoded
  with a key/value cache for all such rows of the batch at once.
- The row's input embedding becomes the sum of the frame's codec embeddings plus the request's
  trailing text embedding for that step (`tts_pad` once the text ran out), as transformers'
  ``Qwen3OmniMoeTalkerForConditionalGeneration.prepare_inputs_for_generation`` builds it.
- Frames are kept per request and position (in the request's side-input store entry, which lives
  as long as the request in the `ar` runtime), so recomputing a preempted request (its generated
  tokens come back as a prefill) or resuming a request held for more text (a new vLLM request whose
  prompt ends with the tokens generated so far) reuses them: the result does not depend on
  scheduling.
- Each row's frame leaves through the bridge's capture side channel (`HiddenStateCapture`'s rows:
  ``[rows, num_code_groups]`` int64, -1 for prompt rows), which the `ar` runtime drains per step.

Per-request side inputs (trailing text so far, whether it is complete, tts_pad, optional M-RoPE
positions) come through the bridge's side-input store (`HiddenStateCapture.omni_side`), updated
while the request runs as the thinker streams (see `omni_qwen3.talker.TalkerModel`). A step never
reads text that has not arrived: the runtime stops the request at its token budget first.
This module imports vLLM and transformers: load it only in a worker.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

from omni_core.stages.vllm_bridge import FIRST_PROMPT_LEN, RESUMED_TOKENS, CapturedRows, HiddenStateCapture

ARCHITECTURE = "OmniQwen3OmniTalkerForCausalLM"
# Keys of the model's own per-request state in the side-input store entry.
_FRAMES = "_frames"
_LAST_HIDDEN = "_last_hidden"

_NO_CODE = -1  # frame value of prompt rows in the side channel


def talker_hf_config(config: Any) -> Any:
    """`hf_overrides` for vLLM: the full Qwen3-Omni config -> its talker config, our architecture."""
    talker = getattr(config, "talker_config", config)
    talker.architectures = [ARCHITECTURE]
    return talker


class Qwen3OmniTalkerForCausalLM(HiddenStateCapture, Qwen3MoeForCausalLM, SupportsMRoPE):
    """The talker LM plus its code predictor; emits one codec frame per decode row."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration,
        )

        talker_config = vllm_config.model_config.hf_config
        predictor_config = talker_config.code_predictor_config
        predictor_config._attn_implementation = "sdpa"
        self.num_code_groups = int(talker_config.num_code_groups)
        self.code_predictor = Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration._from_config(
            predictor_config, dtype=vllm_config.model_config.dtype
        )
        self.code_predictor.eval()
        self._predictor_rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of positions 0..N-1

    # --- vLLM hooks ---------------------------------------------------------------------------

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[torch.Tensor, int]:
        # Prompts come as embeddings: text positions here; requests with multimodal (3-D)
        # positions carry them as side inputs and `forward` puts them in.
        positions = torch.arange(len(input_tokens), dtype=torch.long).view(1, -1).expand(3, -1)
        return positions.clone(), 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Take the `talker.*` tensors of the full checkpoint (thinker/code2wav ones are skipped)."""

        def talker_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if not name.startswith("talker."):
                    continue
                name = name[len("talker.") :]
                if name.startswith(("text_projection.", "hidden_projection.")):
                    continue  # used by the thinker -> talker edge adapter, not by the LM
                if name == "model.codec_embedding.weight":
                    name = "model.embed_tokens.weight"
                elif name.startswith("codec_head."):
                    name = "lm_head." + name[len("codec_head.") :]
                yield name, tensor

        return Qwen3MoeForCausalLM.load_weights(self, talker_weights())

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        layout = self._layout()
        frames: list[torch.Tensor] = []
        if layout:
            if inputs_embeds is None:
                raise RuntimeError("the Qwen3-Omni talker needs enable_prompt_embeds=True")
            inputs_embeds, positions, frames = self._prepare(layout, inputs_embeds, positions)
        hidden = Qwen3MoeForCausalLM.forward(self, input_ids, positions, intermediate_tensors, inputs_embeds)
        for (req_id, row_start, row_end, pos_start), rows in zip(layout, frames):
            # The code predictor's input for the next frame (kept across a resumption too).
            self.omni_side(req_id)[_LAST_HIDDEN] = hidden[row_end - 1].detach().clone()
            self.omni_captured.append(CapturedRows(req_id, pos_start, rows))
        return hidden

    # --- per-step work ------------------------------------------------------------------------

    def _layout(self) -> list[tuple[str, int, int, int]]:
        """(request id, first row, end row, position of the first row) per request in the batch;
        empty for dummy/profiling runs."""
        if self.omni_request_order is None:
            return []
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return []
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):
            metadata = metadata[0] if metadata else None
        if not metadata:
            return []
        layer_metadata = next(iter(metadata.values()))
        request_ids = list(self.omni_request_order())
        n = len(request_ids)
        starts = layer_metadata.query_start_loc[: n + 1].tolist()
        seq_lens = layer_metadata.seq_lens[:n].tolist()
        return [
            (rid, starts[i], starts[i + 1], seq_lens[i] - (starts[i + 1] - starts[i]))
            for i, rid in enumerate(request_ids)
            if starts[i + 1] > starts[i]
        ]

    def _prepare(
        self, layout: list[tuple[str, int, int, int]], inputs_embeds: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Frames and input embeddings of the generated-token rows; M-RoPE positions of requests
        that carry their own."""
        groups = self.num_code_groups
        embeds = inputs_embeds.clone()
        positions = positions.clone()
        new_rows: list[tuple[str, int, int]] = []  # (request, row, generated index) needing a frame
        code0: list[int] = []
        greedy: list[bool] = []
        for req_id, row_start, row_end, pos_start in layout:
            state = self.omni_request_state(req_id)
            side = self.omni_side(req_id)
            prompt_len = _prompt_len(state, side)
            mrope = side.get("mrope_positions")
            if mrope is not None and positions.ndim == 2:
                positions[:, row_start:row_end] = _mrope_rows(mrope, int(side.get("mrope_delta", 0)), pos_start, row_end - row_start)
            cached: list[torch.Tensor] = side.setdefault(_FRAMES, [])
            for row in range(max(row_start, row_start + prompt_len - pos_start), row_end):
                index = pos_start + (row - row_start) - prompt_len  # generated token index
                if index >= len(cached):
                    if index != len(cached) or _LAST_HIDDEN not in side:
                        raise RuntimeError(f"talker request {req_id}: no frame state for generated token {index}")
                    new_rows.append((req_id, row, index))
                    code0.append(_generated_token(state, side, index))
                    greedy.append(float(getattr(state.sampling_params, "temperature", 0.0) or 0.0) <= 0.0)
        if new_rows:
            past = torch.stack([self.omni_side(req_id)[_LAST_HIDDEN] for req_id, _, _ in new_rows])
            first = torch.tensor(code0, device=embeds.device, dtype=torch.long)
            # The codebook-0 embeddings from the table, not from `inputs_embeds`: a resumed request's
            # last token arrives as a prompt row (a placeholder), not as a decode row.
            residual = self._predict_residuals(past, self.model.embed_input_ids(first), torch.tensor(greedy))
            for (req_id, _, index), frame in zip(new_rows, torch.cat([first[:, None], residual], dim=1)):
                cached = self.omni_side(req_id)[_FRAMES]
                assert index == len(cached)
                cached.append(frame.cpu())
        frames: list[torch.Tensor] = []
        for req_id, row_start, row_end, pos_start in layout:
            state = self.omni_request_state(req_id)
            side = self.omni_side(req_id)
            prompt_len = _prompt_len(state, side)
            out = torch.full((row_end - row_start, groups), _NO_CODE, dtype=torch.long)
            first_row = max(row_start, row_start + prompt_len - pos_start)
            if first_row < row_end:
                first_index = pos_start + (first_row - row_start) - prompt_len
                frame_block = torch.stack(side[_FRAMES][first_index : first_index + row_end - first_row])
                out[first_row - row_start :] = frame_block
                embeds[first_row:row_end] = self._frame_embeds(frame_block.to(embeds.device)) + _text_rows(
                    side, first_index, row_end - first_row, embeds
                )
            frames.append(out)
        return embeds, positions, frames

    @torch.inference_mode()
    def _predict_residuals(self, past_hidden: torch.Tensor, code0_embeds: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
        """Codebooks 1..N-1 for each row, decoded with a key/value cache as the reference's
        ``code_predictor.generate`` does: a 2-token prefill, then one token per codebook.

        The transformers layers' own submodules do the math; the loop around them (a preallocated
        cache of N positions, rotary tables computed once) avoids the model-level mask and cache
        machinery, which costs more than the tiny predictor's arithmetic per call.
        """
        predictor = self.code_predictor
        model = predictor.model
        groups = self.num_code_groups
        rows = past_hidden.shape[0]
        if self._predictor_rope is None or self._predictor_rope[0].device != past_hidden.device:
            positions = torch.arange(groups, device=past_hidden.device)[None]
            self._predictor_rope = model.rotary_emb(past_hidden, positions)  # cos, sin [1, N, head_dim]
        cos, sin = self._predictor_rope
        first = model.layers[0].self_attn
        cache = [
            past_hidden.new_zeros((2, rows, model.config.num_key_value_heads, groups, first.head_dim))
            for _ in model.layers
        ]
        hidden = torch.stack([past_hidden, code0_embeds], dim=1)
        sampling = not bool(greedy.all())  # (before the move: no device sync)
        greedy = greedy.to(past_hidden.device)
        start = 0
        codes = []
        for step in range(groups - 1):
            length = hidden.shape[1]
            for layer, kv in zip(model.layers, cache):
                hidden = _predictor_layer(layer, hidden, cos[:, start : start + length], sin[:, start : start + length], kv, start)
            start += length
            logits = predictor.lm_head[step](model.norm(hidden[:, -1]))
            code = logits.argmax(-1)
            if sampling:  # (sampling costs as much as a predictor layer: only when a row samples)
                code = torch.where(greedy, code, _sample_top_k_top_p(logits))
            codes.append(code)
            if step + 2 < groups:
                hidden = model.codec_embedding[step](code)[:, None]
        return torch.stack(codes, dim=1)

    def _frame_embeds(self, frames: torch.Tensor) -> torch.Tensor:
        """Sum of a frame's codec embeddings: the talker's for codebook 0, the predictor's for the rest."""
        total = self.model.embed_input_ids(frames[:, 0])
        for group in range(1, self.num_code_groups):
            total = total + self.code_predictor.model.codec_embedding[group - 1](frames[:, group])
        return total



def _predictor_layer(layer: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, start: int) -> torch.Tensor:
    """One code-predictor decoder layer over new positions [start, start+T), caching their keys and values."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb

    attn = layer.self_attn
    rows, length, _ = hidden.shape
    normed = layer.input_layernorm(hidden)
    shape = (rows, length, -1, attn.head_dim)
    q = attn.q_norm(attn.q_proj(normed).view(shape)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(normed).view(shape)).transpose(1, 2)
    v = attn.v_proj(normed).view(shape).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    end = start + length
    kv[0][:, :, start:end] = k
    kv[1][:, :, start:end] = v
    out = torch.nn.functional.scaled_dot_product_attention(
        q, kv[0][:, :, :end], kv[1][:, :, :end], is_causal=length > 1, scale=attn.scaling,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(rows, length, -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _prompt_len(state: Any, side: dict[str, Any]) -> int:
    """Rows of the request's first prompt (a resumed run's prompt also holds generated tokens)."""
    if side.get(FIRST_PROMPT_LEN):
        return int(side[FIRST_PROMPT_LEN])
    if state.prompt_embeds is not None:
        return int(state.prompt_embeds.shape[0])
    return len(state.prompt_token_ids or [])


def _generated_token(state: Any, side: dict[str, Any], index: int) -> int:
    """Codebook-0 token of generated index `index`: from the resumed prompt or this run's output."""
    resumed: list[int] = side.get(RESUMED_TOKENS) or []
    if index < len(resumed):
        return int(resumed[index])
    return int(state.output_token_ids[index - len(resumed)])


def _text_rows(side: dict[str, Any], first: int, count: int, like: torch.Tensor) -> torch.Tensor:
    """Trailing text embeddings for generated indexes [first, first+count); tts_pad past the end
    once the text is complete (before that the runtime never lets a request get there)."""
    trailing: torch.Tensor = side["trailing"]
    pad: torch.Tensor = side["tts_pad"]
    if first + count > trailing.shape[0] and not side.get("text_final", True):
        raise RuntimeError(
            f"talker step needs trailing text row {first + count - 1} but only {trailing.shape[0]} arrived: "
            "the token budget should have held the request"
        )
    out = pad.to(like.device, like.dtype).view(1, -1).expand(count, -1).clone()
    available = max(0, min(count, trailing.shape[0] - first))
    if available:
        out[:available] = trailing[first : first + available].to(like.device, like.dtype)
    return out


def _mrope_rows(prompt_positions: torch.Tensor, delta: int, start: int, count: int) -> torch.Tensor:
    """3-D positions of absolute positions [start, start+count): the prompt's own, then p + delta."""
    index = torch.arange(start, start + count)
    out = (index + delta).view(1, -1).expand(3, -1).clone()
    inside = index < prompt_positions.shape[1]
    out[:, inside] = prompt_positions[:, index[inside]]
    return out


def _sample_top_k_top_p(logits: torch.Tensor, top_k: int = 50, top_p: float = 0.8) -> torch.Tensor:
    """The code predictor's sampling when the talker samples (transformers: top_k 50, top_p 0.8)."""
    values, indices = logits.float().topk(min(top_k, logits.shape[-1]), dim=-1)
    probs = values.softmax(-1)
    keep = probs.cumsum(-1) - probs < top_p
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    choice = torch.multinomial(probs / probs.sum(-1, keepdim=True), 1)
    return indices.gather(-1, choice).squeeze(-1)


__all__ = ["ARCHITECTURE", "Qwen3OmniTalkerForCausalLM", "talker_hf_config"]
