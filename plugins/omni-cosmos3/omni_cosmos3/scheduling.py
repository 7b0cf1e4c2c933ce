"""`UniPCMultistepScheduler.step` with its scalar arithmetic on the host, so a step never waits for the device.

diffusers computes each step's coefficients (log-SNRs, the order conditions and their solution) from
sigmas it moves to the sample's device one at a time, and solves there. On CUDA every such move and
the solve wait until the device has finished all the work queued before them (eight waits a step),
so the device idles while the host then queues the rest of the step and the next forward: about 2 ms
of a 41 ms step for eight 512-pixel images on an H200. `scheduler_step` is the same arithmetic in the
same order with the scalars on the CPU (where diffusers keeps the sigmas), the tensor expressions
diffusers' own; on a CPU it is diffusers' step operation for operation. Schedulers and settings it
does not cover (another scheduler, a `solver_p`, noise prediction without ``predict_x0``) take
diffusers' `step`.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_cosmos3 import diffusers_private


def scheduler_step(scheduler: Any, model_output: torch.Tensor, timestep: Any, sample: torch.Tensor) -> torch.Tensor:
    """``scheduler.step(model_output, timestep, sample, return_dict=False)[0]``, for UniPC without device waits."""
    from diffusers import UniPCMultistepScheduler

    s = scheduler
    if not isinstance(s, UniPCMultistepScheduler) or s.solver_p is not None or not s.predict_x0:
        return s.step(model_output, timestep, sample, return_dict=False)[0]
    if s.step_index is None:
        diffusers_private.init_step_index(s, timestep)
    use_corrector = s.step_index > 0 and s.step_index - 1 not in s.disable_corrector and s.last_sample is not None
    converted = s.convert_model_output(model_output, sample=sample)
    if use_corrector:  # UniC: corrects the previous prediction with this step's model output
        sample = _update(s, s.step_index, s.last_sample, s.this_order, model_t=converted)
    for i in range(s.config.solver_order - 1):
        s.model_outputs[i] = s.model_outputs[i + 1]
        s.timestep_list[i] = s.timestep_list[i + 1]
    s.model_outputs[-1] = converted
    s.timestep_list[-1] = timestep
    order = s.config.solver_order
    if s.config.lower_order_final:
        order = min(order, len(s.timesteps) - s.step_index)
    s.this_order = min(order, s.lower_order_nums + 1)  # warm-up of the multistep history
    s.last_sample = sample
    prev_sample = _update(s, s.step_index + 1, sample, s.this_order)  # UniP: predicts the next sample
    if s.lower_order_nums < s.config.solver_order:
        s.lower_order_nums += 1
    diffusers_private.advance_step_index(s)
    return prev_sample


def _update(s: Any, t: int, x: torch.Tensor, order: int, model_t: torch.Tensor | None = None) -> torch.Tensor:
    """From sigma index ``t - 1`` to ``t``: `multistep_uni_p_bh_update` or, given this step's converted
    output `model_t`, `multistep_uni_c_bh_update` (which corrects `x`, the sample the last step started from)."""
    sigmas = s.sigmas.cpu()
    alpha_t, sigma_t = diffusers_private.sigma_to_alpha_sigma_t(s, sigmas[t])
    alpha_s0, sigma_s0 = diffusers_private.sigma_to_alpha_sigma_t(s, sigmas[t - 1])
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
    h = lambda_t - lambda_s0
    m0 = s.model_outputs[-1]
    rks, d1s = [], []
    for i in range(1, order):
        alpha_si, sigma_si = diffusers_private.sigma_to_alpha_sigma_t(s, sigmas[t - 1 - i])
        lambda_si = torch.log(alpha_si) - torch.log(sigma_si)
        rk = (lambda_si - lambda_s0) / h
        rks.append(rk)
        d1s.append((s.model_outputs[-(i + 1)] - m0) / rk)
    rks.append(torch.ones(()))
    rks = torch.stack(rks)

    hh = -h
    h_phi_1 = torch.expm1(hh)  # h * phi_1(h) = e^h - 1
    h_phi_k = h_phi_1 / hh - 1
    b_h = hh if s.config.solver_type == "bh1" else torch.expm1(hh)
    factorial_i = 1
    r, b = [], []
    for i in range(1, order + 1):
        r.append(torch.pow(rks, i - 1))
        b.append(h_phi_k * factorial_i / b_h)
        factorial_i *= i + 1
        h_phi_k = h_phi_k / hh - 1 / factorial_i
    r, b = torch.stack(r), torch.stack(b)

    # The coefficients go to the device as queued copies (staged from pageable memory, not waited for).
    device, dtype = x.device, x.dtype
    x_t_ = sigma_t / sigma_s0 * x - alpha_t * h_phi_1 * m0
    if model_t is None:
        pred_res: Any = 0
        if d1s:
            rhos_p = torch.ones(1, dtype=dtype) * 0.5 if order == 2 else torch.linalg.solve(r[:-1, :-1], b[:-1]).to(dtype)
            pred_res = torch.einsum("k,bkc...->bc...", rhos_p.to(device, non_blocking=True), torch.stack(d1s, dim=1))
        return (x_t_ - alpha_t * b_h * pred_res).to(dtype)
    rhos_c = torch.ones(1, dtype=dtype) * 0.5 if order == 1 else torch.linalg.solve(r, b).to(dtype)
    corr_res: Any = 0
    if d1s:
        corr_res = torch.einsum("k,bkc...->bc...", rhos_c[:-1].to(device, non_blocking=True), torch.stack(d1s, dim=1))
    return (x_t_ - alpha_t * b_h * (corr_res + rhos_c[-1] * (model_t - m0))).to(dtype)
