"""One copy of HunyuanImage-3.0's weights for ar -> dit (issue 25, point 3): memory on CPU (not a test).

    python bench/hunyuan_shared_memory.py          # CPU, float32: ~1.9 GB of decoder weights, a few minutes

Writes (under ``--scratch``) a random bfloat16 checkpoint in the release layout (both stages load it
as float32, so each copy is memory of its own), ``--layers`` layers of hidden 1024,
16 experts (top 4) of 1024 plus the shared one, with the tiny checkpoint's VAE and vision tower. Then,
each in a fresh process, an Omni engine serves one ``think_t2i`` request (the ``ar`` stage reasons on
vLLM, the ``dit`` stage draws after it) with

1. the family's default deploy: ``dit.share_model_with: ar``, the ``dit`` stage's worker in the ``ar``
   stage's process, on the modules its vLLM model loaded (one copy of the decoder);
2. ``deploy/two-copies.yaml``: each stage in its own process with its own copy (as vLLM-Omni's
   AR -> DiT runs).

Reported: the stage processes' resident memory (``VmRSS``) once both stages are loaded and their
peaks (``VmHWM``) after the request, summed over the distinct processes, against the size of the
decoder's weights. Results: ``$OUT/hunyuan-shared-memory.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from diffusion import write_table
from hunyuan_image3 import write_release_width

SPEC = {
    "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2, "attention_head_dim": 128,
    "num_experts": 16, "moe_topk": 4, "moe_intermediate_size": 1024, "patch_embed_hidden_dim": 256,
    "image_base_size": 128, "tokenizer_vocab": 512, "vae_blocks": [32, 32, 64, 64, 64],
    "vae_layers_per_block": 2, "vit_width": 32,
}


def _status_mib(pid: int, field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of process `pid`, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def child(model: Path, shared: bool) -> dict[str, float]:
    """Run in a fresh process: start the deploy, serve one think_t2i request; the stage processes'
    memory (a process both stages share is counted once)."""
    import numpy as np

    from omni_core.engine.offline import Omni
    from omni_core.engine.request import OmniRequest

    deploy = None if shared else "omni_hunyuan:deploy/two-copies.yaml"
    # float32 from a bfloat16 checkpoint: each loader casts, so each copy is memory of its own (a
    # same-dtype load would keep safetensors' memory-mapped file pages, which processes share).
    overrides = ["ar.max_model_len=512", "ar.dtype=float32", "dit.dtype=float32"]
    began = time.perf_counter()
    with Omni(str(model), deploy=deploy, overrides=overrides) as engine:
        engine.generate(OmniRequest(prompt="warm-up", modalities=("text",), params={"ar": {"max_tokens": 2}}))
        load_s = time.perf_counter() - began
        health = engine.health()
        pids = sorted({h["pid"] for h in health})
        loaded = sum(_status_mib(pid, "VmRSS") for pid in pids)
        request = OmniRequest(
            prompt="A lighthouse at night", modalities=("text", "image"), extra={"seed": 1},
            params={"ar": {"max_tokens": 16}, "dit": {"num_inference_steps": 4}},
        )
        result = engine.generate(request)[0]
        image = np.asarray(result.images[0])
        peak = sum(_status_mib(pid, "VmHWM") for pid in pids)
    return {"processes": len(pids), "loaded_mib": loaded, "peak_mib": peak, "load_s": load_s,
            "image_mean": float(image.mean()), "tokens": len(result.token_ids)}


def decoder_bytes(model: Path) -> tuple[int, int]:
    """Bytes in float32 of the decoder's tensors (``model.*``) and of the rest of the transformer."""
    from safetensors import safe_open

    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    decoder = rest = 0
    for shard in sorted(set(index.values())):
        with safe_open(str(model / shard), framework="pt") as reader:
            for key in reader.keys():  # noqa: SIM118 (a safetensors reader)
                if key.startswith(("vae.", "vision_model.", "vision_aligner.")):
                    continue
                tensor = reader.get_slice(key)
                size = 4  # as loaded (float32)
                count = 1
                for n in tensor.get_shape():
                    count *= n
                if key.startswith("model."):
                    decoder += count * size
                else:
                    rest += count * size
    return decoder, rest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/omni-bench-hunyuan-shared"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    parser.add_argument("--child", choices=("shared", "two-copies"), help=argparse.SUPPRESS)  # (one configuration)
    args = parser.parse_args()
    model = args.scratch / f"cpu-bf16-{args.layers}"
    if args.child:
        print(json.dumps(child(model, args.child == "shared")))
        return
    write_release_width(model, args.layers, "cpu", spec=SPEC, dtype="bfloat16")
    decoder, rest = decoder_bytes(model)
    runs = {}
    for mode in ("shared", "two-copies"):
        done = subprocess.run(
            [sys.executable, __file__, "--layers", str(args.layers), "--scratch", str(args.scratch), "--child", mode],
            capture_output=True, text=True, check=True,
        )
        runs[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        print(mode, runs[mode], flush=True)
    gib = 2**30
    lines = [
        f"## HunyuanImage-3.0 ar -> dit on one copy of the weights (CPU, float32 from a bfloat16 checkpoint, "
        f"{args.layers} layers of hidden 1024, 16 experts top 4)",
        "",
        f"Decoder weights (`model.*`, shared when `share_model_with: ar`): {decoder / gib:.2f} GiB; the transformer's other "
        f"tensors (LM head, timestep embedders, UNet embedder and head, the dit's own): {rest / gib:.2f} GiB. One "
        "think_t2i request (16 reasoning tokens on vLLM, 4 denoising steps); memory of the stage processes.",
        "",
        "| deploy | stage processes | resident after loading (GiB) | peak resident (GiB) | loading (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode, label in (("shared", "default: `dit.share_model_with: ar` (one copy)"), ("two-copies", "`deploy/two-copies.yaml`")):
        run = runs[mode]
        lines.append(f"| {label} | {run['processes']} | {run['loaded_mib'] / 1024:.2f} | {run['peak_mib'] / 1024:.2f} | {run['load_s']:.0f} |")
    saved = (runs["two-copies"]["peak_mib"] - runs["shared"]["peak_mib"]) / 1024
    weights = (decoder + rest) / gib
    lines += [
        "",
        f"One copy: a peak of {runs['shared']['peak_mib'] / 1024:.2f} GiB for {weights:.2f} GiB of transformer weights (the rest: "
        f"torch and vLLM, the KV cache, the VAE and vision tower, activations). Two copies take {saved:.2f} GiB more: the "
        f"decoder's second copy ({decoder / gib:.2f} GiB) and a second process. The same image either way: "
        f"{runs['shared']['image_mean'] == runs['two-copies']['image_mean']} (mean pixel {runs['shared']['image_mean']:.3f} "
        f"and {runs['two-copies']['image_mean']:.3f}).",
    ]
    write_table(lines, args.out / "hunyuan-shared-memory.md")


if __name__ == "__main__":
    main()
