"""Cache acceleration for diffusion transformers: first-block residual caching (TeaCache-style).

Consecutive denoising steps change a DiT's hidden states slowly. Each step the model runs its first
block and measures how much that block's output residual changed since the last step that ran
the whole stack (relative L1). While the change accumulated since then stays under `threshold`,
the remaining blocks are skipped and the residual they added last time is reused. The first
`warmup_steps` steps and the last step always compute. ``threshold=0`` never skips (the output is
then exactly the uncached one).

The decision is per sample row, so a batch can mix rows that compute and rows that reuse: the
model runs the remaining blocks only on the rows that compute. Selected per deploy (the
``cache`` option of the diffusion stage) and per request (the ``cache`` stage parameter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Literal

import attrs

from omni_core.engine.params import int_param, number_param
from omni_core.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

CacheMode = Literal["none", "first_block"]
CACHE_MODES: tuple[str, ...] = ("none", "first_block")


@attrs.frozen
class CacheConfig:
    """A resolved cache setting for one request."""

    mode: CacheMode = "none"
    threshold: float = 0.1
    warmup_steps: int = 1

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


def resolve_cache(default: CacheConfig, requested: Any) -> CacheConfig:
    """Merge a request's ``cache`` parameter over the deploy's default.

    Accepted: ``None`` (the default), ``false``/``"none"``/``"off"`` (off), ``true`` or
    ``"first_block"`` (on), a number (on, with that threshold) or a mapping with ``mode``,
    ``threshold``, ``warmup_steps``.
    """
    if requested is None:
        return default
    if requested is False or requested in ("none", "off"):
        return attrs.evolve(default, mode="none")
    if requested is True or requested == "first_block":
        return attrs.evolve(default, mode="first_block")
    if isinstance(requested, (int, float)) and not isinstance(requested, bool):
        return _checked(attrs.evolve(default, mode="first_block", threshold=number_param(requested, "cache")))
    if isinstance(requested, dict):
        unknown = sorted(set(requested) - {"mode", "threshold", "warmup_steps"})
        if unknown:
            raise InvalidRequestError(f"unknown cache keys {unknown}; use mode, threshold, warmup_steps", param="cache")
        mode = requested.get("mode", "first_block")
        if mode not in CACHE_MODES:
            raise InvalidRequestError(f"cache mode must be one of {CACHE_MODES}, got {mode!r}", param="cache")
        threshold = number_param(requested.get("threshold", default.threshold), "cache.threshold")
        warmup = int_param(requested.get("warmup_steps", default.warmup_steps), "cache.warmup_steps")
        return _checked(CacheConfig(mode=mode, threshold=threshold, warmup_steps=warmup))
    raise InvalidRequestError(
        f"cache must be 'none', 'first_block', a threshold number or an object, got {requested!r}", param="cache"
    )


def _checked(config: CacheConfig) -> CacheConfig:
    if config.threshold < 0 or config.warmup_steps < 0:
        raise InvalidRequestError("cache threshold and warmup_steps must be >= 0", param="cache")
    return config


@attrs.define
class CacheState:
    """Per-row (sample x guidance branch) state of first-block caching."""

    config: CacheConfig
    previous_signal: dict[int, Any] = attrs.field(factory=dict)  # row -> first-block residual of the last computed step
    residual: dict[int, Any] = attrs.field(factory=dict)  # row -> residual the skipped blocks added last time
    accumulated: dict[int, float] = attrs.field(factory=dict)
    computed_steps: int = 0
    skipped_steps: int = 0


def decide(
    states: list[tuple[CacheState | None, int]], signals: torch.Tensor, step: list[int], total: list[int],
    sum_over_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[bool]:
    """Which rows must run the remaining blocks this step.

    `states[i]` is row i's (cache state, branch index); `signals[i]` its first-block residual;
    `step`/`total` the row's sample's step and step count. Rows without cache state always compute.
    `sum_over_tokens`: where each rank holds a share of the tokens (Ulysses), sums per-row partial
    sums over the ranks (`Parallel.sum_over_tokens`), so every rank takes the same decisions.
    """
    candidates: list[int] = []  # rows that may skip: their change since the last computed step decides
    for i, (state, branch) in enumerate(states):
        if state is None or not state.config.enabled:
            continue
        must = (
            state.previous_signal.get(branch) is None
            or branch not in state.residual
            or step[i] < state.config.warmup_steps
            or step[i] >= total[i] - 1
        )
        if not must:
            candidates.append(i)
    changes = _relative_changes(states, signals, candidates, sum_over_tokens)
    compute = [True] * len(states)
    for i, change in zip(candidates, changes):
        state, branch = states[i]
        assert state is not None
        accumulated = state.accumulated.get(branch, 0.0) + change
        if accumulated < state.config.threshold:
            state.accumulated[branch] = accumulated
            compute[i] = False
    return compute


def _relative_changes(
    states: list[tuple[CacheState | None, int]], signals: torch.Tensor, rows: list[int],
    sum_over_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[float]:
    """Relative L1 change of each row's signal since its last computed step, in float32.

    Computed for all rows at once and read back with one transfer: a read per row would wait for
    the GPU once per row. float32, because a bfloat16 mean over a large signal loses the small
    changes the threshold is about.
    """
    if not rows:
        return []
    import torch

    current = signals[rows].float()
    previous = torch.stack([states[i][0].previous_signal[states[i][1]] for i in rows]).float()  # type: ignore[union-attr]
    if sum_over_tokens is not None:  # the ratio of sums is the ratio of means over the whole row
        sums = sum_over_tokens(torch.stack([(current - previous).abs().flatten(1).sum(1), previous.abs().flatten(1).sum(1)]))
        change = sums[0] / sums[1].clamp_min(1e-12)
        return [float(x) for x in change.tolist()]
    change = (current - previous).abs().flatten(1).mean(1) / previous.abs().flatten(1).mean(1).clamp_min(1e-12)
    return [float(x) for x in change.tolist()]


def record(state: CacheState | None, branch: int, signal: torch.Tensor, residual: torch.Tensor | None) -> None:
    """After a step: remember a computing row's signal and residual (``None``: the row reused)."""
    if state is None or not state.config.enabled:
        return
    if residual is not None:
        state.previous_signal[branch] = signal.detach().clone()
        state.residual[branch] = residual.detach().clone()
        state.accumulated[branch] = 0.0
        if branch == 0:
            state.computed_steps += 1
    elif branch == 0:
        state.skipped_steps += 1


def device_rows(index: list[int], device: Any) -> torch.Tensor:
    """Row numbers as an index on `device`. Indexing with the list itself copies it there and waits
    for everything queued on the device (a stall each step); this copy is queued instead."""
    import torch

    return torch.tensor(index).to(device, non_blocking=True)


def finish_rows(
    states: list[tuple[CacheState | None, int]], first: torch.Tensor, signal: torch.Tensor, compute: list[bool],
    run_rest: Callable[[list[int], torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The whole stack's output for a batch with one sample row per index of dim 0, after `decide`.

    `first` is every row's output of the first block and `signal` its first-block residual;
    `run_rest(index, rows)` runs the remaining blocks on the rows `index` (`rows`: the same numbers
    as an index on the device) and returns their outputs. The other rows add the residual the
    remaining blocks added at their last computed step (one batched add). Records every row."""
    import torch

    out = first.clone()
    index = [i for i, c in enumerate(compute) if c]
    if index:
        rows = device_rows(index, first.device)
        out.index_copy_(0, rows, run_rest(index, rows))
    reused = [i for i, c in enumerate(compute) if not c]
    if reused:
        rows = device_rows(reused, first.device)
        residuals = torch.stack([states[i][0].residual[states[i][1]] for i in reused])  # type: ignore[union-attr]
        out.index_copy_(0, rows, first.index_select(0, rows) + residuals)
    for i, (state, branch) in enumerate(states):
        record(state, branch, signal[i], out[i] - first[i] if compute[i] else None)
    return out
