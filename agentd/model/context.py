"""A context longer than the model was trained for, by YaRN's RoPE interpolation.

Coding agents' first prompts are 8-23k tokens (Codex ~9k, opencode ~8k, Claude Code ~23k with
its tools), past the 8,192 the default model was trained on. ``--max-model-len`` above a model's
context stretches its rotary frequencies with YaRN (Peng et al., 2023: "YaRN: Efficient Context
Window Extension of Large Language Models"): the high frequencies, which turn many times within
the trained context, are kept; the low ones are interpolated by the extension factor; a ramp
blends the two; and attention logits are scaled by ``0.1 ln(factor) + 1``. It is the method a
model's own config names when it ships with a longer context (Qwen2.5's ``rope_scaling``), and
llama.cpp's ``--rope-scaling yarn``.

Invariants: a model whose config already scales its RoPE (its own YaRN, Llama 3's frequency
factors) is not stretched again (``extend_context`` refuses, naming the option); the stretched
model's fingerprint differs from the plain one's (its config says so), so no KV computed with
one serves the other; the cost is said once, in a warning.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from agentd.model.load_errors import ModelLoadError

logger = logging.getLogger("agentd")
BETA_FAST, BETA_SLOW = 32.0, 1.0  # YaRN's ramp bounds, in rotations over the trained context


@dataclass(frozen=True)
class ContextExtension:
    trained_len: int
    max_model_len: int

    @property
    def factor(self) -> float:
        return self.max_model_len / self.trained_len


def yarn_inv_freq(theta: float, head_dim: int, factor: float,
                  trained_len: int) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies for ``head_dim`` and the attention scaling that goes with
    them (transformers' ``yarn`` RoPE type computes the same)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    extrapolated = 1.0 / theta**exponents
    interpolated = extrapolated / factor

    def dim_for(rotations: float) -> float:  # the dim whose wave turns ``rotations`` times
        return head_dim * math.log(trained_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_for(BETA_FAST)), 0)
    high = min(math.ceil(dim_for(BETA_SLOW)), head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low)
            / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return interpolated * (1 - keep) + extrapolated * keep, 0.1 * math.log(factor) + 1.0


def extend_context(config, max_model_len: int | None) -> ContextExtension | None:
    """Stretch ``config`` (in place) to ``max_model_len`` tokens when that is more than the
    model's own context; None when it is not. Raises ModelLoadError for a model whose RoPE is
    scaled already."""
    trained = config.max_position_embeddings
    if max_model_len is None or max_model_len <= trained:
        return None
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    scaled = (params or {}).get("rope_type", (params or {}).get("type", "default"))
    if scaled not in (None, "default") or getattr(config, "rope_freq_factors", None):
        raise ModelLoadError(
            f"--max-model-len {max_model_len} is past this model's context of {trained} tokens, "
            f"and its RoPE is scaled already; lower --max-model-len to at most {trained}")
    extension = ContextExtension(trained, max_model_len)
    _set(config, "max_position_embeddings", max_model_len)
    _set(config, "context_extension", {"method": "yarn", "trained_len": trained,
                                       "max_model_len": max_model_len})
    logger.warning(
        "context %d is %.1fx the %d tokens this model was trained on: RoPE stretched with YaRN. "
        "Its outputs now differ from the model's own at every length, and what it recalls far "
        "back is weaker than a model trained that long; --max-model-len %d serves it unstretched",
        max_model_len, extension.factor, trained, trained)
    return extension


def extension_of(config) -> ContextExtension | None:
    found = getattr(config, "context_extension", None)
    if not found:
        return None
    return ContextExtension(found["trained_len"], found["max_model_len"])


def _set(config, name: str, value: object) -> None:
    values = getattr(config, "_values", None)  # agentd's ModelConfig keeps a dict
    if isinstance(values, dict):
        values[name] = value
    else:
        setattr(config, name, value)
