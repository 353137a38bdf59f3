"""A CPU stand-in for vLLM 0.33's ``OnlineAcceptanceEstimator`` in plain torch.

Same constructor, class constants, attributes (shapes, dtypes, float32 like
vLLM's tensors) and methods; the math of vLLM's Triton kernels written as
vectorised torch (docs/design.md §1):

* ``predict``: feature ``x = -log Σ_{v≠argmax} exp(z_v - m)`` (= ``logit(q_max)``)
  on temperature-scaled logits (temperature 0 leaves them unscaled), clamped
  to ±40, with exactly one argmax term removed. vLLM's kernel subtracts the
  argmax's ``e^0 = 1`` from the float32 total instead; the two agree unless
  the non-argmax mass is below float32 resolution, where vLLM saturates to +40.
  Rows with ``idx_mapping < 0`` (CUDA-graph padding) are skipped.
* ``step``: per position k over the live requests, with ``a = max(s-1, 0)``,
  ``d = a + rejected``, observed iff ``k <= a and k < d``, label ``k < a``,
  ``ω = p(1-p)`` from the draft-time prediction: accumulate ``a_k, b_k, c_k``
  (``info``), ``g0_k, g1_k`` (``grad``) and ``n_k`` (``counts``); every
  ``REFIT_INTERVAL`` steps one damped Newton step on the arrowhead system
  (ridge ``L2``, damping ``n/(n+50)``, slope step zeroed if NaN or if it would
  make the slope negative, intercept steps zeroed if NaN), then clear.

The refit counter statements are written exactly as vLLM's, since the shim
depends on them (see ``avest_client.vllm.contract``).
"""

from __future__ import annotations

import torch

from avest_wire.limits import MAX_LOG_ODDS

_MAX_LOG_ODDS = MAX_LOG_ODDS
_INIT_SLOPE = 0.5
_INIT_BIAS = -0.2


class StandinAcceptanceEstimator:
    REFIT_INTERVAL = 100
    DAMPING_OBSERVATIONS = 50.0
    L2 = 1e-3

    def __init__(self, max_num_reqs: int, num_speculative_steps: int, device: torch.device):
        self.num_speculative_steps = num_speculative_steps
        self.device = device
        self._steps_since_refit = 0
        self._refits = 0
        k = num_speculative_steps
        self.slope = torch.full((1,), _INIT_SLOPE, dtype=torch.float32, device=device)
        self.intercepts = torch.full((k,), _INIT_BIAS, dtype=torch.float32, device=device)
        self.features = torch.zeros(max_num_reqs, k, dtype=torch.float32, device=device)
        self.predictions = torch.zeros(max_num_reqs, k, dtype=torch.float32, device=device)
        self.info = torch.zeros(k, 3, dtype=torch.float32, device=device)
        self.grad = torch.zeros(k, 2, dtype=torch.float32, device=device)
        self.counts = torch.zeros(k, dtype=torch.float32, device=device)
        self._positions = torch.arange(k, device=device)

    def step(
        self,
        idx_mapping: torch.Tensor,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
    ) -> None:
        self._accumulate(idx_mapping, num_sampled, num_rejected)
        self._steps_since_refit += 1
        if self._steps_since_refit < self.REFIT_INTERVAL:
            return
        self._steps_since_refit = 0
        self._refit()
        self._refits += 1

    def _accumulate(self, idx_mapping, num_sampled, num_rejected) -> None:
        accepted = (num_sampled.to(torch.int64) - 1).clamp_(min=0)[:, None]
        admitted = accepted + num_rejected.to(torch.int64)[:, None]
        k = self._positions[None, :]
        observed = (k <= accepted) & (k < admitted)
        label = (k < accepted).to(torch.float32)
        x = self.features[idx_mapping]
        p = self.predictions[idx_mapping]
        w = torch.where(observed, p * (1.0 - p), 0.0)
        r = torch.where(observed, label - p, 0.0)
        self.info[:, 0] += (w * x * x).sum(0)
        self.info[:, 1] += (w * x).sum(0)
        self.info[:, 2] += w.sum(0)
        self.grad[:, 0] += (r * x).sum(0)
        self.grad[:, 1] += r.sum(0)
        self.counts += observed.to(torch.float32).sum(0)

    def _refit(self) -> None:
        a_k, b_k = self.info[:, 0], self.info[:, 1]
        c_k = self.info[:, 2] + self.L2
        a = a_k.sum() + self.L2
        g0 = self.grad[:, 0].sum()
        g1_k = self.grad[:, 1]
        n = self.counts
        w = self.slope[0]
        step_w = (g0 - (b_k * g1_k / c_k).sum()) / (a - (b_k * b_k / c_k).sum())
        total = n.sum()
        step_w = step_w * (total / (total + self.DAMPING_OBSERVATIONS))
        keep = (step_w == step_w) & (w + step_w >= 0.0)
        step_w = torch.where(keep, step_w, torch.zeros_like(step_w))
        step_b = (g1_k - b_k * step_w) / c_k
        step_b = step_b * (n / (n + self.DAMPING_OBSERVATIONS))
        step_b = torch.where(step_b == step_b, step_b, torch.zeros_like(step_b))
        self.slope.copy_((w + step_w).reshape(1))
        self.intercepts.add_(step_b)
        self.info.zero_()
        self.grad.zero_()
        self.counts.zero_()

    def predict(
        self,
        logits: torch.Tensor,
        idx_mapping: torch.Tensor,
        draft_step: torch.Tensor,
        confidence_probs: torch.Tensor,
        temperature: torch.Tensor,
    ) -> None:
        num_tokens = logits.shape[0]
        idx = idx_mapping[:num_tokens].to(torch.int64)
        valid = idx >= 0
        safe_idx = idx.clamp(min=0)
        temp = temperature[safe_idx].to(torch.float32)
        temp = torch.where(temp > 0.0, temp, torch.ones_like(temp))
        z = logits.to(torch.float32) / temp[:, None]
        feature = logit_qmax(z)
        if draft_step.dim() > 0:
            step = draft_step[:num_tokens].to(torch.int64)
            batch = torch.arange(num_tokens, device=logits.device) // self.num_speculative_steps
        else:
            step = draft_step.to(torch.int64).expand(num_tokens)
            batch = torch.arange(num_tokens, device=logits.device)
        prob = torch.sigmoid(self.slope[0] * feature + self.intercepts[step])
        rows, cols = idx[valid], step[valid]
        self.features[rows, cols] = feature[valid]
        self.predictions[rows, cols] = prob[valid]
        confidence_probs[batch[valid], cols] = prob[valid]

    # Test convenience (not in vLLM): write features as predict would, from
    # features instead of logits, for trace-driven tests.
    def load_features(self, idx_mapping: torch.Tensor, features: torch.Tensor) -> None:
        x = features.to(torch.float32)
        self.features[idx_mapping] = x
        self.predictions[idx_mapping] = torch.sigmoid(self.slope[0] * x + self.intercepts[None, :])


def logit_qmax(z: torch.Tensor) -> torch.Tensor:
    """``-log Σ_{v≠argmax} exp(z_v - m)`` per row, clamped to ±40 (float32)."""
    m = z.max(dim=-1, keepdim=True).values
    e = torch.exp(z - m)
    e.scatter_(-1, z.argmax(dim=-1, keepdim=True), 0.0)
    rest = e.sum(-1)
    return (-torch.log(rest)).clamp(-_MAX_LOG_ODDS, _MAX_LOG_ODDS)
