"""Streaming Code2Wav: each request's pre-transformer and convolution stack keep their state between chunks.

transformers' ``Qwen3OmniMoeCode2Wav`` is a sliding-window pre-transformer followed by a stack of
causal convolutions (upsampling, ConvNeXt, SnakeBeta residual units). Re-feeding left-context frames
makes chunked decoding exact but decodes the context again through the whole model: the
pre-transformer's receptive field is its layers times its sliding window (592 frames for the
released model). `PreTransformer` and `ConvStack` run the model incrementally instead, on the same
modules. The pre-transformer keeps each layer's last ``window - 1`` keys and values per request,
so a chunk's new frames attend to exactly what a full decode's sliding window shows them; every
causal convolution keeps the last ``(kernel - 1) * dilation`` samples of its input per request and
every overlapping transposed convolution its last input sample, so a chunk's new frames alone give
exactly the samples a full decode gives for them. A request's first chunk starts from nothing
(empty caches, zeros), which is where the full decode starts.

Batched: the chunks of many requests run right-padded in one pass. A request that starts from
zeros loses the first samples of each overlapping transposed convolution, as the full decode
trims them; those samples are tracked per row as a leading region (``lead``) that is zeroed before
every convolution, which is what the full decode's zero padding sees there, and cut at the end.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch


@attrs.define
class StreamState:
    """One request's decoder state between chunks and the next frame it expects."""

    next_frame: int
    tensors: list[torch.Tensor]  # per stateful convolution op (`ConvStack` order): [C, 1, width]
    attention: "AttentionState"


@attrs.define
class AttentionState:
    """One request's pre-transformer cache: the keys and values of its last ``window - 1`` frames
    per layer, right-aligned (`valid` of them real), and the position of its next frame."""

    keys: torch.Tensor  # [layers, kv_heads, window - 1, head_dim]
    values: torch.Tensor
    valid: int
    position: int


class PreTransformer:
    """The sliding-window pre-transformer of a loaded ``Qwen3OmniMoeCode2Wav``, run incrementally
    over right-padded rows, each from its own cache (`AttentionState`, ``None``: from the start)."""

    def __init__(self, model: Any) -> None:
        self.model = model.pre_transformer
        config = self.model.config
        self.window = int(config.sliding_window)
        self.layers = list(self.model.layers[: config.num_hidden_layers])

    @torch.inference_mode()
    def run(
        self, hidden: torch.Tensor, lengths: list[int], states: list[AttentionState | None]
    ) -> tuple[torch.Tensor, list[AttentionState]]:
        """`hidden` [B, T, H] (row i's first `lengths[i]` frames are real) -> the last hidden state
        [B, T, H] and each row's cache after its frames."""
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb

        rows, length, _ = hidden.shape
        past = self.window - 1
        first = self.layers[0].self_attn
        kv_heads = self.model.config.num_key_value_heads
        shape = (len(self.layers), kv_heads, past, first.head_dim)
        keys = torch.stack([s.keys if s else hidden.new_zeros(shape) for s in states], dim=1)  # [L, B, ...]
        values = torch.stack([s.values if s else hidden.new_zeros(shape) for s in states], dim=1)
        valid = torch.tensor([s.valid if s else 0 for s in states], device=hidden.device)
        start = torch.tensor([s.position if s else 0 for s in states], device=hidden.device)
        cos, sin = self.model.rotary_emb(hidden, start[:, None] + torch.arange(length, device=hidden.device))
        mask = self._mask(valid, torch.tensor(lengths, device=hidden.device), length)
        new_keys, new_values = [], []
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            normed = layer.input_layernorm(hidden)
            q = attn.q_norm(attn.q_proj(normed).view(rows, length, -1, attn.head_dim)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(normed).view(rows, length, -1, attn.head_dim)).transpose(1, 2)
            v = attn.v_proj(normed).view(rows, length, -1, attn.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k = torch.cat([keys[index], k], dim=2)
            v = torch.cat([values[index], v], dim=2)
            new_keys.append(k)
            new_values.append(v)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=q.shape[1] != k.shape[1]
            )
            out = attn.o_proj(out.transpose(1, 2).reshape(rows, length, -1))
            hidden = hidden + layer.self_attn_layer_scale(out)
            hidden = hidden + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(hidden)))
        hidden = self.model.norm(hidden)
        # Each row's cache now ends after its last real frame: keep the `past` entries before that.
        all_keys, all_values = torch.stack(new_keys), torch.stack(new_values)  # [L, B, heads, past + T, d]
        new_states = []
        for row, (size, state) in enumerate(zip(lengths, states)):
            end = past + size
            new_states.append(AttentionState(
                all_keys[:, row, :, end - past : end].clone(), all_values[:, row, :, end - past : end].clone(),
                min(past, int(valid[row]) + size), int(start[row]) + size,
            ))
        return hidden, new_states

    def _mask(self, valid: torch.Tensor, lengths: torch.Tensor, length: int) -> torch.Tensor:
        """[B, 1, T, past + T]: query t sees cached slot j (at distance t + past - j) when it is real
        and inside the window, and new frame u <= t when u is real (a padding query sees itself)."""
        past = self.window - 1
        device = valid.device
        t = torch.arange(length, device=device)[:, None]
        j = torch.arange(past, device=device)[None, :]
        cached = (j >= t)[None] & (j >= past - valid[:, None, None])  # [B, T, past]
        u = torch.arange(length, device=device)[None, :]
        new = (u <= t) & (t - u < self.window)
        new = (new[None] & (u[None] < lengths[:, None, None])) | (u == t)[None]
        return torch.cat([cached, new], dim=-1)[:, None]


@attrs.define
class _Op:
    kind: str  # "pointwise", "conv", "tconv", "convnext", "residual", "clamp"
    module: Any
    width: int = 0  # samples of state kept (conv: (k-1)*dilation; tconv with overlap: 1)
    stride: int = 1
    snakes: tuple["_Snake", ...] = ()  # the op's SnakeBeta activations, in order
    convs: tuple["_Conv", ...] = ()  # the op's convolutions, in order


class ConvStack:
    """The upsampling and decoder stack of a loaded ``Qwen3OmniMoeCode2Wav``, run incrementally.

    `compiled`: its SnakeBeta activations run as one ``torch.compile`` kernel each. On this
    project's 2-core CPU that measured about 10x faster than the eager element-wise ops (eager
    ``sin`` alone costs several times the whole fused kernel), and eager activations are a third of
    the stack's time.
    """

    def __init__(self, model: Any, compiled: bool = False) -> None:
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

        self._types = hf
        self.compiled = compiled
        self.snake = torch.compile(_snake, dynamic=True) if compiled else _snake_inplace
        ops: list[_Op] = []
        for blocks in model.upsample:
            for block in blocks:
                ops.append(self._op(block))
        for block in model.decoder:
            if isinstance(block, hf.Qwen3OmniMoeCode2WavDecoderBlock):
                ops.extend(self._op(inner) for inner in block.block)
            else:
                ops.append(self._op(block))
        self.ops = ops

    def _op(self, module: Any) -> _Op:
        hf = self._types
        if isinstance(module, hf.Qwen3OmniMoeCausalConvNet):
            if module.stride != 1:
                raise NotImplementedError("streaming decode supports stride-1 causal convolutions only")
            return _Op("conv", module, width=module.kernel_size - 1, convs=(_Conv(module.conv),))
        if isinstance(module, hf.Qwen3OmniMoeCausalTransConvNet):
            kernel, stride = module.conv.kernel_size[0], module.conv.stride[0]
            if kernel not in (stride, 2 * stride) or module.left_pad != kernel - stride:
                raise NotImplementedError(f"streaming decode: transposed convolution kernel {kernel}, stride {stride}")
            return _Op("tconv", module, width=1 if kernel == 2 * stride else 0, stride=stride, convs=(_Conv(module.conv),))
        if isinstance(module, hf.Qwen3OmniMoeConvNeXtBlock):
            return _Op("convnext", module, width=module.dwconv.kernel_size - 1, convs=(_Conv(module.dwconv.conv),))
        if isinstance(module, hf.Qwen3OmniMoeCode2WavDecoderResidualUnit):
            if module.conv2.kernel_size != 1:
                raise NotImplementedError("streaming decode: residual units end in a 1-sample convolution")
            return _Op(
                "residual", module, width=module.conv1.kernel_size - 1,
                snakes=(self._snake(module.act1), self._snake(module.act2)), convs=(_Conv(module.conv1.conv), _Conv(module.conv2.conv)),
            )
        if isinstance(module, hf.Qwen3OmniMoeSnakeBeta):
            return _Op("pointwise", module, snakes=(self._snake(module),))
        raise NotImplementedError(f"streaming decode: unexpected module {type(module).__name__}")

    def _snake(self, module: Any) -> "_Snake":
        return _Snake(module, self.snake)

    @torch.inference_mode()
    def run(
        self, hidden: torch.Tensor, lengths: list[int], states: list[StreamState | None]
    ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """Decode `hidden` [B, H, T] (right-padded; `lengths` valid frames per row) from `states`
        (``None``: the row starts from zeros). Returns each row's new samples and its new states.

        Inside, signals are [B, C, 1, T] in channels-last memory and convolutions are their 2-D
        equivalents: oneDNN's channels-last kernels are up to 2x faster at the decoder's few channels.
        """
        rows = hidden.shape[0]
        fresh = [state is None for state in states]
        end = list(lengths)
        lead = [0] * rows
        new_states: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        index = 0  # the next state slot
        x = hidden.unsqueeze(2).contiguous(memory_format=torch.channels_last)
        for op in self.ops:
            if op.kind == "pointwise":
                x = op.snakes[0](x)
            elif op.kind == "tconv":
                if op.width:
                    joined = self._with_state(x, states, index, op.width, end, new_states)
                    index += 1
                    x = op.convs[0](joined)[..., op.stride : op.stride + x.shape[-1] * op.stride]
                    # A row starting from zeros loses its first block, as the full decode trims it.
                    lead = [(lead[i] + fresh[i]) * op.stride for i in range(rows)]
                else:
                    x = op.convs[0](x)
                    lead = [value * op.stride for value in lead]
                end = [value * op.stride for value in end]
            elif op.kind == "conv":
                x = op.convs[0](self._with_state(_zero_lead(x, lead), states, index, op.width, end, new_states))
                index += 1
            elif op.kind == "convnext":
                block = op.module
                x = _zero_lead(x, lead)
                h = op.convs[0](self._with_state(x, states, index, op.width, end, new_states)).squeeze(2).transpose(1, 2)
                index += 1
                h = block.pwconv2(block.act(block.pwconv1(block.norm(h))))
                x = x + (block.gamma * h).transpose(1, 2).unsqueeze(2)
            else:  # residual unit: act1 -> causal conv1 -> act2 -> 1-sample conv2, plus the input
                (act1, act2), (conv1, conv2) = op.snakes, op.convs
                h = _zero_lead(act1(x), lead)
                h = conv1(self._with_state(h, states, index, op.width, end, new_states))
                index += 1
                x = x + conv2(act2(h))
        x = x.clamp(min=-1, max=1)
        return [x[i, 0, 0, lead[i] : end[i]] for i in range(rows)], new_states

    @staticmethod
    def _with_state(
        x: torch.Tensor, states: list[StreamState | None], index: int, width: int, end: list[int],
        new_states: list[list[torch.Tensor]],
    ) -> torch.Tensor:
        """`x` with each row's past `width` input samples in front; records the rows' next states."""
        rows, channels = x.shape[0], x.shape[1]
        joined = torch.empty((rows, channels, 1, width + x.shape[-1]), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
        zeros = x.new_zeros((channels, 1, width))
        joined[..., :width] = torch.stack([zeros if state is None else state.tensors[index] for state in states])
        joined[..., width:] = x
        # Each row's last `width` real samples: [end, end + width) in joined coordinates.
        positions = torch.tensor(end, device=x.device)[:, None] + torch.arange(width, device=x.device)
        tail = joined.gather(3, positions[:, None, None, :].expand(-1, channels, 1, -1))
        for row, state in zip(new_states, tail.unbind(0)):
            row.append(state)
        return joined


class _Conv:
    """A ``Conv1d`` / ``ConvTranspose1d`` (no padding) as its 2-D equivalent over channels-last
    [B, C, 1, T], with the weight prepared once."""

    def __init__(self, conv: Any) -> None:
        if any(conv.padding) or (isinstance(conv, torch.nn.ConvTranspose1d) and any(conv.output_padding)):
            raise NotImplementedError("streaming decode: convolutions pad their input themselves")
        self.transposed = isinstance(conv, torch.nn.ConvTranspose1d)
        self.weight = conv.weight.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last)
        self.bias = None if conv.bias is None else conv.bias.detach()
        self.stride, self.dilation, self.groups = (1, conv.stride[0]), (1, conv.dilation[0]), conv.groups

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        function = torch.nn.functional.conv_transpose2d if self.transposed else torch.nn.functional.conv2d
        return function(x, self.weight, self.bias, stride=self.stride, groups=self.groups, dilation=self.dilation)


class _Snake:
    """A ``Qwen3OmniMoeSnakeBeta`` activation with its parameters' exponentials taken once.

    It runs on the signal as ``[samples, C]`` rows (the channels-last memory of ``[B, C, 1, T]``,
    no copy), so a compiled activation sees one dynamic size: 1 or more rows, two compiled graphs.
    """

    def __init__(self, module: Any, function: Any) -> None:
        self.alpha = module.alpha.detach().exp()
        self.inv_beta = 1.0 / (module.beta.detach().exp() + module.no_div_by_zero)
        self.function = function

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, channels, _, samples = x.shape
        flat = x.permute(0, 2, 3, 1).reshape(-1, channels)
        out = self.function(flat, self.alpha, self.inv_beta)
        return out.view(rows, 1, samples, channels).permute(0, 3, 1, 2)


def _snake(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
    """SnakeBeta, ``x + 1 / beta * sin(x * alpha) ** 2``, from exponentiated parameters (compiled)."""
    return torch.addcmul(x, torch.sin(x * alpha).square(), inv_beta)


def _snake_inplace(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
    """`_snake` in eager mode with one temporary instead of the module's five allocating passes."""
    wave = torch.mul(x, alpha).sin_()
    return torch.addcmul(x, wave.mul_(wave), inv_beta)


def _zero_lead(x: torch.Tensor, lead: list[int]) -> torch.Tensor:
    """`x` with each row's leading `lead` samples zeroed (what a full decode's zero padding holds there)."""
    if not any(lead):
        return x
    keep = torch.arange(x.shape[-1], device=x.device)[None, :] >= torch.tensor(lead, device=x.device)[:, None]
    return x * keep[:, None, None, :].to(x.dtype)
