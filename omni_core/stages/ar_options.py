"""`AROptions`: the deploy options of an `ar` stage (vLLM engine settings), one documented field each."""

from __future__ import annotations

from typing import Any

import attrs

_positive = [attrs.validators.instance_of(int), attrs.validators.gt(0)]


@attrs.frozen
class AROptions:
    """Deploy options of an `ar` stage (vLLM engine settings).

    Each field's ``metadata["doc"]`` documents it (`omni stages ar`, ``docs/stage-options.md``).
    """

    max_num_seqs: int = attrs.field(
        default=32, validator=_positive, metadata={"doc": "Most requests in one engine step (vLLM's ``max_num_seqs``)."}
    )
    max_model_len: int | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(_positive),
        metadata={"doc": "Longest sequence, prompt and output, in tokens (``None``: the checkpoint's context length)."},
    )
    max_num_batched_tokens: int | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(_positive),
        metadata={"doc": "Most tokens scheduled in one engine step (vLLM's ``max_num_batched_tokens``; ``None``: vLLM's default)."},
    )
    dtype: str = attrs.field(
        default="auto",
        metadata={
            "doc": "vLLM's dtype (``auto``: the checkpoint's, but float32 checkpoints run in bfloat16 on CPU), or "
            "``checkpoint``: exactly the dtype the checkpoint's weights are stored in (transformers' "
            '``torch_dtype="auto"``; `omni_core.config.modelref.checkpoint_dtype`).'
        },
    )
    kv_cache_memory_bytes: int | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(_positive),
        metadata={
            "doc": "Bytes of KV cache. ``None``: on CPU, 256 MiB or room for two sequences of the full "
            "`max_model_len`, whichever is more (from the model's layers, KV heads, head size and dtype; vLLM "
            "would otherwise reserve most of the machine's memory for each stage); on GPU, "
            "`gpu_memory_utilization` decides."
        },
    )
    gpu_memory_utilization: float = attrs.field(
        default=0.9,
        validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)],
        metadata={
            "doc": "On GPU, the fraction of the device's memory the stage's vLLM engine may take (weights, "
            "activations and KV cache) when `kv_cache_memory_bytes` is ``None``."
        },
    )
    enforce_eager: bool = attrs.field(
        default=True,
        metadata={"doc": "Run the model eagerly, without vLLM's CUDA graphs and compilation (faster start, slower GPU steps)."},
    )
    seed: int = attrs.field(
        default=0, metadata={"doc": "vLLM's engine seed; a request's own ``seed`` parameter wins for that request."}
    )
    quantization: str | None = attrs.field(
        default=None,
        metadata={
            "doc": "A registered quantization resolver (``fp8``, ``int8``, ...; `omni plugins` lists them) whose "
            "answer is passed to vLLM; ``None``: the weights as the checkpoint stores them."
        },
    )
    enable_prompt_embeds: bool = attrs.field(
        default=False,
        metadata={"doc": "Accept prompt embeddings as input (vLLM's ``enable_prompt_embeds``); on anyway when the model part needs them."},
    )
    engine_args: dict[str, Any] = attrs.field(
        factory=dict,
        metadata={"doc": "Any other vLLM `EngineArgs` keywords, passed through; they win over everything else."},
    )
    streamed_input_min_tokens: int = attrs.field(
        default=4,
        validator=_positive,
        metadata={
            "doc": "A request of a streamed-input model part (re)enters vLLM once its input allows this many more "
            "tokens (or its input is final); fewer means lower latency but more resumptions (each re-prefills the "
            "request, unless the model part is resumable: then each costs a step, and the first start needs one token)."
        },
    )
    admission_window_ms: float = attrs.field(
        default=0.0,
        validator=attrs.validators.ge(0),
        metadata={
            "doc": "When the stage is idle, how long its first new request waits for others sent with it, so they "
            "prefill together and move through the pipeline as one batch (0: never)."
        },
    )
