"""Per-sample state of the Cosmos3 model part, and the scheduler groups that step the vision
latents of samples admitted together as one batch."""

from __future__ import annotations

import copy
from typing import Any

import attrs
import torch

from omni_core.stages.diffusion_model import DiffusionSample
from omni_cosmos3.scheduling import scheduler_step
from omni_cosmos3.tasks import Request


@attrs.define
class Row:
    """One guidance branch of a sample: its prompt ids, positions and the reasoner's keys/values."""

    input_ids: list[int]
    text_positions: torch.Tensor  # [3, N]
    gen_positions: torch.Tensor  # [3, M]
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer: keys for gen [N, kvh, hd], values


@attrs.define(eq=False)
class Conditioning:
    """A request's action condition: its conditioning frames (padded pixels until `start` encodes
    them, then clean latents) and its embodiment's action width."""

    pixels: torch.Tensor | None  # [1, 3, T, H, W] in [-1, 1], the tier's canvas
    image_size: torch.Tensor  # [canvas_h, canvas_w, content_h, content_w]
    raw_dim: int  # the embodiment's action width (diffusers' CosmosActionCondition.raw_action_dim)
    latents: torch.Tensor | None = None  # [1, C, T, h, w]: the content part of the encoded canvas


@attrs.define
class Actions:
    """Action state of a sample: the action stream is denoised beside the vision latents."""

    domain_id: int
    raw_dim: int  # the embodiment's action width; the channels beyond it stay zero
    length: int  # action tokens (chunk_size)
    noisy_frames: torch.Tensor  # [T] 1.0 where a vision latent frame is generated, 0.0 where it is conditioning
    conditioning: Conditioning
    generator: torch.Generator  # draws the noise in `start`, after the encode, in the pipeline's order
    latents: torch.Tensor | None = None  # [length, action_dim] float32
    scheduler: Any = None


@attrs.define
class SampleState:
    request: Request
    rows: list[Row]
    latents: torch.Tensor  # [1, C, T, h, w] float32
    scheduler: Any
    sound_latents: torch.Tensor | None = None  # [Cs, Ts] float32
    sound_scheduler: Any = None
    actions: Actions | None = None
    group: SchedulerGroup | None = None  # steps its latents with the others admitted with it


@attrs.define(eq=False)
class SchedulerGroup:
    """Samples admitted together with the same shape and step count: one scheduler steps their
    vision latents as one batch (a scheduler call per sample is a hundred small kernels).

    The scheduler's update is elementwise per sample (no thresholding), so each member gets what its
    own scheduler would give. Members step in lockstep (the runtime denoises every running sample of
    a shape each step); one that left (aborted) keeps a placeholder row until the group finishes.
    """

    scheduler: Any
    members: list[SampleState]


def group_schedulers(samples: list[DiffusionSample]) -> None:
    """Group newly admitted samples that will step in lockstep with equal timesteps."""
    if any(sample.state.scheduler.config.get("thresholding") for sample in samples):
        return  # thresholding reduces over each sample: not batchable
    by_schedule: dict[Any, list[SampleState]] = {}
    for sample in samples:
        by_schedule.setdefault((sample.batch_key, sample.total_steps), []).append(sample.state)
    for members in by_schedule.values():
        if len(members) > 1:
            group = SchedulerGroup(copy.deepcopy(members[0].scheduler), members)
            for state in members:
                state.group = group


def group_step(group: SchedulerGroup, t: Any, velocities: dict[int, torch.Tensor]) -> None:
    """One scheduler step for a group's present members; absent ones get a zero placeholder."""
    members = group.members
    present = next(iter(velocities.values()))
    velocity = torch.stack([velocities.get(id(state), torch.zeros_like(present)) for state in members])  # [S, C, T, h, w]
    latents = torch.cat([state.latents for state in members])  # [S, C, T, h, w]
    out = scheduler_step(group.scheduler, velocity.unsqueeze(0), t, latents.unsqueeze(0)).squeeze(0)
    for index, state in enumerate(members):
        if id(state) in velocities:
            state.latents = out[index : index + 1]


# -- a batch's rows (each one guidance branch of a sample; `row_sample[i]`: row i's sample) ------


def row_branch(row_sample: list[int], i: int) -> int:
    """Guidance branch of row i within its sample (0: conditional)."""
    return i - row_sample.index(row_sample[i])


def float_rows(local: torch.Tensor | None, shape: Any, device: torch.device) -> torch.Tensor:
    """A rank's per-row predictions in float32; zero rows of `shape` when it has none."""
    if local is None:
        return torch.zeros(0, *shape, device=device)
    return local.float()


def noisy_frames_rows(states: list[SampleState], row_sample: list[int]) -> torch.Tensor:
    """[B, 1, T, 1, 1]: 1 on the generated latent frames of each row's sample, 0 on conditioning frames."""
    frames = torch.stack([st.actions.noisy_frames for st in states])[row_sample]
    return frames[:, None, :, None, None]


def guided(preds: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance over a sample's rows (one row: no guidance)."""
    if preds.shape[0] == 1:
        return preds[0]
    cond, uncond = preds[0], preds[1]
    return uncond + scale * (cond - uncond)
