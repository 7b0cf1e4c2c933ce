"""The tiny Qwen3-Omni talker's end of speech: weights that make it emit the codec EOS on its own.

Random weights never pick the codec end token; `shape_speech_end` gives the tiny checkpoint's talker
a private channel that ends its speech after about `SPEECH_FRAMES` frames (see there). Used only by
`omni_qwen3.tiny.make_tiny`.
"""

from __future__ import annotations

from typing import Any

import attrs

from omni_qwen3.tiny import INIT_STD, SEED, SPEECH_FRAMES


def shape_speech_end(model: Any) -> None:
    """Make the talker end its speech on its own (codec EOS) about `SPEECH_FRAMES` frames in (`omni_qwen3.tiny.make_tiny` calls it).

    Random weights never pick EOS, so an uncapped request would speak until the talker's
    max_tokens (4096 frames, 5.5 minutes). Three coordinates of the talker's residual stream become
    a private channel that no other weight writes or reads (their rows and columns are zero):

    - ``const``: the same value in every input row (the text and hidden projections' bias);
    - ``mark``: nonzero only in the speakers' codec embeddings, so only on the prompt's speaker row
      (three rows before the first frame, there however short the thinker's text; codec ids above
      the codebook are never sampled, so never fed back);
    - ``signal``: written by one query head of the last layer alone.

    That head's query reads ``const`` and its KV head's key reads ``mark``, both in one rotary pair
    (the pair carries nothing else in the layer), so the head scores the speaker row
    ``S * cos(theta * d - psi)`` from a row ``d`` positions after it, whatever the content, and
    every other row 0. Rotary embeddings are relative: ``d`` counts the frames generated so far,
    whatever the prompt. While the cosine is well above 0 the head attends to the speaker row and
    copies its ``mark`` into ``signal`` (and the rest of its value, the voice, into every frame:
    the speakers' embeddings are scaled up so that the voice tells in the first frames). ``psi``
    puts the zero crossing at `SPEECH_FRAMES`, after which the head looks elsewhere and ``signal``
    drops to 0 within a frame or two. The codec head's EOS row is ``gamma * (const - 8 * signal)``:
    far below the best codebook logit while the signal lasts and far above it after (the other rows
    do not read the channel), so greedy and sampled decoding (temperature 0.9, top-k 50) both stop
    there, after 45-49 frames (3.6-3.9 s). The magnitudes are calibrated on the model itself
    (`_talker_probe`): the residual stream's scale grows with the preset's width and depth. The
    other heads and layers and the code predictor keep their random weights.
    """
    import math

    import torch

    talker = model.talker
    config = model.config.talker_config
    text = config.text_config
    hidden, head_dim = text.hidden_size, text.head_dim
    const, mark, signal = hidden - 1, hidden - 2, hidden - 3
    channel = [const, mark, signal]
    half = head_dim // 2
    inv_freq = [text.rope_parameters["rope_theta"] ** (-2 * k / head_dim) for k in range(half)]
    # The fastest rotary pair still under a radian by SPEECH_FRAMES: its cosine turns negative at
    # SPEECH_FRAMES and stays so for the next pi / theta (hundreds of) positions.
    pair = next(k for k in range(half) if inv_freq[k] * SPEECH_FRAMES <= 1.0)
    psi = inv_freq[pair] * SPEECH_FRAMES - math.pi / 2
    # The last layer: the earlier ones keep all their heads for the content.
    layer = talker.model.layers[-1]
    attention = layer.self_attn
    head = text.num_attention_heads // text.num_key_value_heads - 1  # the last query head of KV head 0
    query = slice(head * head_dim, (head + 1) * head_dim)
    speakers = sorted(int(i) for i in config.speaker_id.values())
    with torch.no_grad():
        # Writers: only the input rows below and the signal head.
        talker.model.codec_embedding.weight[:, channel] = 0.0
        for embedding in talker.code_predictor.model.codec_embedding:  # summed into the talker's input
            embedding.weight[:, channel] = 0.0
        for projection in (talker.text_projection, talker.hidden_projection):
            projection.linear_fc2.weight[channel, :] = 0.0
            projection.linear_fc2.bias[channel] = 0.0
        for each in talker.model.layers:
            attn, mlp = each.self_attn, each.mlp
            attn.o_proj.weight[channel, :] = 0.0
            mlp.experts.down_proj[:, channel, :] = 0.0
            mlp.shared_expert.down_proj.weight[channel, :] = 0.0
            # Readers: none but the signal head and the EOS row.
            for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate, mlp.shared_expert_gate,
                           mlp.shared_expert.gate_proj, mlp.shared_expert.up_proj):
                linear.weight[:, channel] = 0.0
            mlp.experts.gate_up_proj[:, :, channel] = 0.0
        talker.codec_head.weight[:, channel] = 0.0
        talker.model.codec_embedding.weight[speakers] *= _SPEAKER_SCALE

        # `const` as large as a typical input coordinate, the mark twice that.
        scale = float(_talker_probe(model, layer).prompt.pow(2).mean().sqrt())
        for projection in (talker.text_projection, talker.hidden_projection):
            projection.linear_fc2.bias[const] = scale
        talker.model.codec_embedding.weight[speakers, mark] = 2.0 * scale
        # The rotary pair carries nothing else in the layer (its q/k norm weights scale it below):
        # the head's query reads `const` there at angle 0, KV head 0's key `mark` at angle psi;
        # every other head's pair is zero (the other query heads of KV head 0 ignore the mark).
        rows = [h * head_dim + d for h in range(text.num_attention_heads) for d in (pair, pair + half)]
        attention.q_proj.weight[rows, :] = 0.0
        attention.q_proj.weight[query, :] = 0.0
        attention.q_proj.weight[head * head_dim + pair, const] = 1.0
        rows = [h * head_dim + d for h in range(text.num_key_value_heads) for d in (pair, pair + half)]
        attention.k_proj.weight[rows, :] = 0.0
        # The key's pair large enough to hold 90% of KV head 0's key of the speaker row (the rest
        # is the row's content).
        normed = layer.input_layernorm(_talker_probe(model, layer).mark_in)
        content = float(attention.k_proj(normed)[:head_dim].pow(2).sum())
        weight = 3.0 * math.sqrt(content) / float(normed[mark])
        attention.k_proj.weight[pair, mark] = weight * math.cos(psi)
        attention.k_proj.weight[pair + half, mark] = weight * math.sin(psi)
        # q/k norms are per head: these two dimensions scale the score S to _SPEECH_SCORE.
        key = attention.k_norm(attention.k_proj(normed).view(-1, head_dim)[0])
        gain = math.sqrt(_SPEECH_SCORE / float(key[[pair, pair + half]].norm()))
        attention.q_norm.weight[[pair, pair + half]] = gain
        attention.k_norm.weight[[pair, pair + half]] = gain
        # The value's dimension `pair`: the mark, to `signal`, about as large as `const` while the
        # head sees the speaker row.
        attention.v_proj.weight[pair, :] = 0.0
        attention.v_proj.weight[pair, mark] = scale / float(normed[mark])
        attention.o_proj.weight[:, head * head_dim + pair] = 0.0
        attention.o_proj.weight[signal, head * head_dim + pair] = 1.0

        # EOS: above the best of the codebook's logits by a wide margin once `signal` is gone, at
        # the scale of the final norm's input.
        final = _talker_probe(model, layer).final
        gamma = (_SPEECH_MARGIN + 4.0 * INIT_STD * math.sqrt(hidden)) * float(final.pow(2).mean().sqrt()) / scale
        eos = talker.codec_head.weight[config.codec_eos_token_id]
        eos.zero_()
        eos[const] = gamma
        eos[signal] = -_SPEECH_SIGNAL_GAIN * gamma


# The attention score of the speaker row near it, and the EOS logit's margin over 4 sigma of the
# codebook's logits (the codec head's rows have INIT_STD entries) once the speech is over.
_SPEECH_SCORE = 100.0
_SPEECH_MARGIN = 30.0
# `signal` is as large as `const` on the probe, a few times more or less in requests (it scales with
# the speaker row's norm in the last layer, which depends on the row's content): EOS stays suppressed
# down to an eighth of it, and `signal` falls far below that a frame or two after SPEECH_FRAMES.
_SPEECH_SIGNAL_GAIN = 8.0
# The speakers' codec embeddings, scaled from INIT_STD: as large as the other codec ids', a speaker
# barely changed the codes; the signal head copies the speaker row into every frame, and with this the
# voice tells from the first frames.
_SPEAKER_SCALE = 3.0


@attrs.frozen
class _Probe:
    prompt: Any  # [rows, H] the talker's input rows of the prompt
    mark_in: Any  # [H] the input of the probed layer at the prompt's speaker row
    final: Any  # [rows, H] the final norm's input at the generated rows


def _talker_probe(model: Any, layer: Any) -> _Probe:
    """Run the talker on a random but typical sequence: a prompt of projected text rows, rows with
    a speaker's, codec_pad's and codec_bos's embeddings, then 2 * SPEECH_FRAMES frames (codec
    embeddings of random codes plus text); return what `_shape_speech_end` calibrates on."""
    import torch

    talker = model.talker
    config = model.config.talker_config
    generator = torch.Generator().manual_seed(SEED)
    table = model.thinker.model.embed_tokens.weight
    codebook = talker.code_predictor.config.vocab_size

    def text_rows(count: int) -> Any:
        return talker.text_projection(table[torch.randint(0, table.shape[0], (count,), generator=generator)])

    prompt = text_rows(12)
    speaker = min(int(i) for i in config.speaker_id.values())
    last = text_rows(3) + talker.model.codec_embedding.weight[[speaker, config.codec_pad_id, config.codec_bos_id]]
    frames = 2 * SPEECH_FRAMES
    codes = torch.randint(0, codebook, (frames, config.num_code_groups), generator=generator)
    generated = talker.model.codec_embedding(codes[:, 0]) + text_rows(frames)
    for group, embedding in enumerate(talker.code_predictor.model.codec_embedding):
        generated = generated + embedding(codes[:, group + 1])
    captured: dict[str, Any] = {}

    def layer_input(_module: Any, args: Any, kwargs: Any) -> None:
        captured["layer"] = args[0] if args else kwargs["hidden_states"]

    handles = [
        layer.register_forward_pre_hook(layer_input, with_kwargs=True),
        talker.model.norm.register_forward_hook(lambda _m, args, _o: captured.setdefault("final", args[0])),
    ]
    try:
        talker.model(inputs_embeds=torch.cat([prompt, last, generated])[None], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    mark = prompt.shape[0]
    return _Probe(prompt=prompt, mark_in=captured["layer"][0, mark], final=captured["final"][0, mark + 3 :])
