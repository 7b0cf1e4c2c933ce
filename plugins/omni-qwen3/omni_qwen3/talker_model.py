"""The Qwen3-Omni Talker as a vLLM model class (registered out of tree by `omni_qwen3.talker`).

vLLM's own `Qwen3MoeForCausalLM` is the talker's language model (shared expert and router map
natively): `talker.model.codec_embedding` is its `embed_tokens`, `talker.codec_head` its `lm_head`.
vLLM samples codebook 0; this class adds what a codec frame needs on top, inside `forward`:

- For every generated codebook-0 token fed back (a decode row), the code predictor turns the
  previous step's final hidden state and that token's embedding into codebooks 1..N-1, decoded
  with a key/value cache for all such rows of the batch at once. The predictor (`CodePredictor`)
  is built from vLLM's layers (fused QKV and gate/up projections, the platform's GEMMs and
  norms), with transformers' ``Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration``
  as its reference (tests compare the codes).
- The row's input embedding becomes the sum of the frame's codec embeddings plus the request's
  trailing text embedding for that step (`tts_pad` once the text ran out), as transformers'
  ``Qwen3OmniMoeTalkerForConditionalGeneration.prepare_inputs_for_generation`` builds it.
- Frames are kept per request and position (in the request's side-input store entry, which lives
  as long as the request in the `ar` runtime), so recomputing a preempted request (its generated
  tokens come back as a prefill) or resuming a request held for more text (its session's next turn
  feeds the last sampled token; a whole re-run's prompt ends with the tokens generated so far)
  reuses them: the result does not depend on scheduling.
- The prompt arrives as placeholder token ids (a resumable request, a vLLM streaming-input session,
  takes no embeddings prompt): its rows come from the side inputs (``prompt_embeds``, plus the
  speaker's codec embedding in ``speaker_row``).
- Each row's frame leaves through the bridge's capture side channel (`HiddenStateCapture.omni_emit_rows`:
  ``[rows, num_code_groups]`` int64, -1 for prompt rows), which the `ar` runtime drains per step.

Per-request side inputs (prompt rows and speaker, trailing text so far, whether it is complete,
tts_pad, optional M-RoPE positions) come through the bridge's side-input store
(`HiddenStateCapture.omni_side`), updated while the request runs as the thinker streams (see
`omni_qwen3.talker.TalkerModel`). A step never reads text that has not arrived: the runtime stops
the request at its token budget first.

The batch (which rows belong to which request, at which positions) and each request's sampling
state (greedy or not, its generator, its sampled tokens) come from the bridge's `HiddenStateCapture`
methods, never from vLLM's runner or forward context: vLLM's model layers and `Qwen3MoeForCausalLM`
are its extension point for out-of-tree models, its runner state is not.
This module imports vLLM and transformers: load it only in a worker.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import get_act_fn
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import SupportsMRoPE
from vllm.model_executor.models.qwen2 import Qwen2MLP
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
from vllm.model_executor.models.utils import maybe_prefix

from omni_core.stages.vllm_bridge import RESUMED_TOKENS, HiddenStateCapture, RequestRows

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
        talker_config = vllm_config.model_config.hf_config
        self.num_code_groups = int(talker_config.num_code_groups)
        # vLLM's quantization (the stage's `quantization` option) reaches these layers too, as it
        # does the talker's own: every linear but the codebook heads (vLLM keeps LM heads unquantized).
        quant_config = vllm_config.quant_config
        self.code_predictor = CodePredictor(
            talker_config.code_predictor_config, prefix=maybe_prefix(prefix, "code_predictor"), quant_config=quant_config
        )
        # The streamed thinker text rows are projected here, a step's rows of every request at once.
        self.text_projection = _ResizeMLP(talker_config, prefix=maybe_prefix(prefix, "text_projection"), quant_config=quant_config)

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
                if name.startswith("hidden_projection."):
                    continue  # used by the thinker -> talker edge adapter (prompt rows), not by the LM
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
        layout = self.omni_batch_layout()
        frames: list[torch.Tensor] = []
        if layout:
            if inputs_embeds is None:
                raise RuntimeError("the Qwen3-Omni talker needs enable_prompt_embeds=True")
            inputs_embeds, positions, frames = self._prepare(layout, inputs_embeds, positions)
        hidden = Qwen3MoeForCausalLM.forward(self, input_ids, positions, intermediate_tensors, inputs_embeds)
        for (req_id, row_start, row_end, pos_start), rows in zip(layout, frames):
            # The code predictor's input for the next frame (kept across a resumption too).
            self.omni_side(req_id)[_LAST_HIDDEN] = hidden[row_end - 1].detach().clone()
            self.omni_emit_rows(req_id, pos_start, rows)
        return hidden

    # --- per-step work ------------------------------------------------------------------------

    def _prepare(
        self, layout: list[RequestRows], inputs_embeds: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Frames and input embeddings of the generated-token rows; M-RoPE positions of requests
        that carry their own."""
        groups = self.num_code_groups
        embeds = inputs_embeds.clone()
        positions = positions.clone()
        new_rows: list[tuple[str, int, int]] = []  # (request, row, generated index) needing a frame
        code0: list[int] = []
        greedy: list[bool] = []
        generators: list[torch.Generator | None] = []
        for req_id, row_start, row_end, pos_start in layout:
            side = self.omni_side(req_id)
            prompt_len = _prompt_len(side)
            mrope = side.get("mrope_positions")
            if mrope is not None and positions.ndim == 2:
                positions[:, row_start:row_end] = _mrope_rows(mrope, int(side.get("mrope_delta", 0)), pos_start, row_end - row_start)
            prompt_end = min(row_end, row_start + prompt_len - pos_start)
            if prompt_end > row_start:
                embeds[row_start:prompt_end] = self._prompt_rows(side, pos_start, prompt_end - row_start, embeds)
            cached: list[torch.Tensor] = side.setdefault(_FRAMES, [])
            for row in range(max(row_start, prompt_end), row_end):
                index = pos_start + (row - row_start) - prompt_len  # generated token index
                if index >= len(cached):
                    if index != len(cached) or _LAST_HIDDEN not in side:
                        raise RuntimeError(f"talker request {req_id}: no frame state for generated token {index}")
                    new_rows.append((req_id, row, index))
                    code0.append(_generated_token(self.omni_output_token_ids(req_id), side, index))
                    greedy.append(self.omni_is_greedy(req_id))
                    generators.append(self.omni_generator(req_id))  # a seeded request's own
        if new_rows:
            past = torch.stack([self.omni_side(req_id)[_LAST_HIDDEN] for req_id, _, _ in new_rows])
            first = torch.tensor(code0, device=embeds.device, dtype=torch.long)
            # The codebook-0 embeddings from the table, not from `inputs_embeds`: a resumed request's
            # last token arrives as a prompt row (a placeholder), not as a decode row.
            residual = self.code_predictor(past, self.model.embed_input_ids(first), torch.tensor(greedy), generators)
            for (req_id, _, index), frame in zip(new_rows, torch.cat([first[:, None], residual], dim=1)):
                cached = self.omni_side(req_id)[_FRAMES]
                assert index == len(cached)
                cached.append(frame.cpu())
        frames: list[torch.Tensor] = []
        spans: list[tuple[dict[str, Any], int, int, torch.Tensor]] = []  # (side inputs, first row, first generated index, frames)
        for req_id, row_start, row_end, pos_start in layout:
            side = self.omni_side(req_id)
            prompt_len = _prompt_len(side)
            out = torch.full((row_end - row_start, groups), _NO_CODE, dtype=torch.long)
            first_row = max(row_start, row_start + prompt_len - pos_start)
            if first_row < row_end:
                first_index = pos_start + (first_row - row_start) - prompt_len
                block = torch.stack(side[_FRAMES][first_index : first_index + row_end - first_row])
                out[first_row - row_start :] = block
                spans.append((side, first_row, first_index, block))
            frames.append(out)
        if spans:
            # One pass for every request's generated rows: codec embeddings plus projected text.
            codes = torch.cat([block for *_, block in spans]).to(embeds.device)
            rows = torch.cat([torch.arange(first, first + len(block)) for _, first, _, block in spans]).to(embeds.device)
            text = self._text_rows([(side, index, len(block)) for side, _, index, block in spans], embeds)
            embeds[rows] = self._frame_embeds(codes) + text
        return embeds, positions, frames

    def _prompt_rows(self, side: dict[str, Any], start: int, count: int, like: torch.Tensor) -> torch.Tensor:
        """Prompt rows [start, start + count) from the side inputs (vLLM holds placeholder ids
        there), the speaker's codec embedding added to its row in float32 (as the reference adds it),
        in `like`'s dtype and device."""
        rows = side["prompt_embeds"][start : start + count].to(like.device, torch.float32, copy=True)
        speaker = side.get("speaker_row")
        if speaker is not None and start <= speaker < start + count:
            codec = self.model.embed_input_ids(torch.tensor([side["speaker_id"]], device=like.device))
            rows[speaker - start] += codec[0].to(torch.float32)
        return rows.to(like.dtype)

    def _text_rows(self, spans: list[tuple[dict[str, Any], int, int]], like: torch.Tensor) -> torch.Tensor:
        """Trailing text embeddings of each span (side inputs, first generated index, count), in
        order: the request's streamed thinker rows projected to the talker's width (all spans in one
        call), then ``tts_pad`` past the end once the text is complete (before that the runtime
        never lets a request get there)."""
        parts = []
        for side, first, count in spans:
            trailing: torch.Tensor = side["trailing"]
            if first + count > trailing.shape[0] and not side.get("text_final", True):
                raise RuntimeError(
                    f"talker step needs trailing text row {first + count - 1} but only {trailing.shape[0]} arrived: "
                    "the token budget should have held the request"
                )
            parts.append(trailing[first : first + max(0, min(count, trailing.shape[0] - first))])
        raw = torch.cat(parts).to(like.device, like.dtype)
        projected = self.text_projection(raw) if raw.shape[0] else raw.new_zeros((0, like.shape[1]))
        out, offset = [], 0
        for (side, _, count), part in zip(spans, parts):
            available = part.shape[0]
            out.append(projected[offset : offset + available])
            offset += available
            if available < count:
                out.append(side["tts_pad"].to(like.device, like.dtype).view(1, -1).expand(count - available, -1))
        return torch.cat(out)

    def _frame_embeds(self, frames: torch.Tensor) -> torch.Tensor:
        """Sum of a frame's codec embeddings: the talker's for codebook 0, the predictor's for the rest."""
        total = self.model.embed_input_ids(frames[:, 0])
        for group in range(1, self.num_code_groups):
            total = total + self.code_predictor.model.codec_embedding[group - 1](frames[:, group])
        return total


class CodePredictor(nn.Module):
    """The talker's code predictor on vLLM layers: codebooks 1..N-1 of a frame from the talker's
    last hidden state and the frame's codebook-0 embedding.

    Parameter names follow the checkpoint's ``talker.code_predictor.*`` (q/k/v and gate/up are
    loaded into fused projections). It decodes the way the reference's ``generate`` does: a
    2-token prefill, then one token per codebook, each step's keys and values kept in a cache of
    N positions for all rows at once; transformers' own model-level mask and cache machinery
    would cost more than this small model's arithmetic.
    """

    def __init__(self, config: Any, prefix: str = "", quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.num_code_groups = int(config.num_code_groups)
        self.model = _PredictorModel(config, prefix=f"{prefix}.model", quant_config=quant_config)
        self.lm_head = nn.ModuleList(
            ReplicatedLinear(config.hidden_size, config.vocab_size, bias=False, prefix=f"{prefix}.lm_head.{i}")
            for i in range(self.num_code_groups - 1)
        )
        first = self.model.layers[0].self_attn
        self.rotary_emb = get_rope(first.head_dim, max_position=self.num_code_groups, rope_parameters=_rope_parameters(config))

    @torch.inference_mode()
    def forward(
        self, past_hidden: torch.Tensor, code0_embeds: torch.Tensor, greedy: torch.Tensor,
        generators: list[torch.Generator | None] | None = None,
    ) -> torch.Tensor:
        """Codes ``[rows, N - 1]``: greedy rows take the argmax, the others sample (`greedy` [rows]),
        from their request's generator where it has one (`generators`, a seeded request's)."""
        model = self.model
        rows, groups = past_hidden.shape[0], self.num_code_groups
        attn = model.layers[0].self_attn
        cache = [past_hidden.new_zeros((2, rows, attn.num_kv_heads, groups, attn.head_dim)) for _ in model.layers]
        hidden = torch.stack([past_hidden, code0_embeds], dim=1).flatten(0, 1)  # [rows * length, H]
        sampling = not bool(greedy.all())  # (before the move: no device sync)
        greedy = greedy.to(past_hidden.device)
        start, length = 0, 2
        codes = []
        for step in range(groups - 1):
            positions = torch.arange(start, start + length, device=hidden.device).repeat(rows)
            for layer, kv in zip(model.layers, cache):
                hidden = layer(hidden, positions, self.rotary_emb, kv, rows, start)
            last = hidden.view(rows, length, -1)[:, -1]
            logits, _ = self.lm_head[step](model.norm(last.contiguous()))
            code = logits.argmax(-1)
            if sampling:  # (sampling costs as much as a predictor layer: only when a row samples)
                code = torch.where(greedy, code, _sample_top_k_top_p(logits, generators))
            codes.append(code)
            if step + 2 < groups:
                hidden = model.codec_embedding[step](code)
            start, length = start + length, 1
        return torch.stack(codes, dim=1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb." in name:
                continue  # (computed, not loaded)
            for fused, part, shard in _FUSED_PARTS:
                if f".{part}." in name:
                    name = name.replace(f".{part}.", f".{fused}.")
                    params[name].weight_loader(params[name], tensor, shard)
                    break
            else:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded


# (fused parameter, checkpoint part, shard) of the code predictor's fused projections.
_FUSED_PARTS = (
    ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
)


def _rope_parameters(config: Any) -> dict[str, Any]:
    parameters = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" not in parameters:  # (older configs: a top-level rope_theta)
        parameters = {"rope_type": "default", **parameters, "rope_theta": getattr(config, "rope_theta", 10000.0)}
    return dict(parameters)


class _ResizeMLP(nn.Module):
    """transformers' ``Qwen3OmniMoeTalkerResizeMLP`` on vLLM layers: thinker rows -> talker width."""

    def __init__(self, config: Any, prefix: str, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        text = config.text_config
        self.linear_fc1 = ReplicatedLinear(
            config.thinker_hidden_size, text.intermediate_size, bias=True, quant_config=quant_config, prefix=f"{prefix}.linear_fc1"
        )
        self.linear_fc2 = ReplicatedLinear(
            text.intermediate_size, text.hidden_size, bias=True, quant_config=quant_config, prefix=f"{prefix}.linear_fc2"
        )
        self.act_fn = get_act_fn(text.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.linear_fc1(x)
        out, _ = self.linear_fc2(self.act_fn(hidden))
        return out


class _PredictorModel(nn.Module):
    def __init__(self, config: Any, prefix: str, quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            _PredictorLayer(config, prefix=f"{prefix}.layers.{i}", quant_config=quant_config) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(config.vocab_size, config.hidden_size) for _ in range(int(config.num_code_groups) - 1)
        )


class _PredictorAttention(nn.Module):
    def __init__(self, config: Any, prefix: str, quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        hidden = config.hidden_size
        self.head_dim = int(getattr(config, "head_dim", None) or hidden // config.num_attention_heads)
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = max(1, config.num_key_value_heads // tp)
        self.scaling = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, config.num_attention_heads, config.num_key_value_heads, bias=bias,
            quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, hidden, bias=bias, quant_config=quant_config, prefix=f"{prefix}.o_proj"
        )
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Any, kv: torch.Tensor, rows: int, start: int) -> torch.Tensor:
        """Attention of new positions [start, start + length) of each row ([rows * length, H]),
        caching their keys and values in `kv` [2, rows, kv_heads, N, head_dim]."""
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q = self.q_norm(q.reshape(-1, heads, dim)).view(-1, heads * dim)
        k = self.k_norm(k.reshape(-1, kv_heads, dim)).view(-1, kv_heads * dim)
        q, k = rotary(positions, q, k)
        length = x.shape[0] // rows
        end = start + length
        kv[0][:, :, start:end] = k.view(rows, length, kv_heads, dim).transpose(1, 2)
        kv[1][:, :, start:end] = v.reshape(rows, length, kv_heads, dim).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.view(rows, length, heads, dim).transpose(1, 2), kv[0][:, :, :end], kv[1][:, :, :end],
            is_causal=length > 1, scale=self.scaling, enable_gqa=heads != kv_heads,
        )
        out, _ = self.o_proj(out.transpose(1, 2).reshape(rows * length, heads * dim))
        return out


class _PredictorLayer(nn.Module):
    def __init__(self, config: Any, prefix: str, quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = _PredictorAttention(config, prefix=f"{prefix}.self_attn", quant_config=quant_config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen2MLP(config.hidden_size, config.intermediate_size, config.hidden_act, quant_config=quant_config, prefix=f"{prefix}.mlp")

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Any, kv: torch.Tensor, rows: int, start: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, kv, rows, start)
        return x + self.mlp(self.post_attention_layernorm(x))


def _prompt_len(side: dict[str, Any]) -> int:
    """Rows of the request's first prompt (its side input; vLLM's prompt grows with resumptions)."""
    return int(side["prompt_embeds"].shape[0])


def _generated_token(output_ids: Sequence[int], side: dict[str, Any], index: int) -> int:
    """Codebook-0 token of generated index `index`: from the resumed prompt or this run's output
    (`output_ids`, what vLLM sampled in this run)."""
    resumed: list[int] = side.get(RESUMED_TOKENS) or []
    if index < len(resumed):
        return int(resumed[index])
    return int(output_ids[index - len(resumed)])


def _mrope_rows(prompt_positions: torch.Tensor, delta: int, start: int, count: int) -> torch.Tensor:
    """3-D positions of absolute positions [start, start+count): the prompt's own, then p + delta."""
    index = torch.arange(start, start + count)
    out = (index + delta).view(1, -1).expand(3, -1).clone()
    inside = index < prompt_positions.shape[1]
    out[:, inside] = prompt_positions[:, index[inside]]
    return out


def _sample_top_k_top_p(
    logits: torch.Tensor, generators: list[torch.Generator | None] | None = None, top_k: int = 50, top_p: float = 0.8
) -> torch.Tensor:
    """The code predictor's sampling when the talker samples (transformers: top_k 50, top_p 0.8);
    rows with a generator draw from it, one row at a time."""
    values, indices = logits.float().topk(min(top_k, logits.shape[-1]), dim=-1)
    probs = values.softmax(-1)
    keep = probs.cumsum(-1) - probs < top_p
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    probs = probs / probs.sum(-1, keepdim=True)
    if generators is not None and any(g is not None for g in generators):
        choice = torch.stack([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators)])
    else:
        choice = torch.multinomial(probs, 1)
    return indices.gather(-1, choice).squeeze(-1)


__all__ = ["ARCHITECTURE", "Qwen3OmniTalkerForCausalLM", "talker_hf_config"]
