"""Cosmos3 for Omni: diffusers' `Cosmos3OmniPipeline` checkpoints served by the diffusion runtime."""
