"""HunyuanImage-3.0 for Omni: one MoE transformer that writes text and denoises image latents."""
