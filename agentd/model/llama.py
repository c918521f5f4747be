"""One Llama-family decoder for Llama 2/3, SmolLM, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm).

The model runs a flattened batch: ``[num_tokens]`` ids and positions from many sequences at
once, with attention over the paged KV pool described by :class:`AttentionMetadata`. Weights keep
transformers' names on load; q/k/v and gate/up are fused into one matmul each.
Invariant: for the same weights, logits equal transformers' within float tolerance.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from agentd.kernels import AttentionBackend
from agentd.kernels.cpu import fused
from agentd.model.context import extension_of, yarn_inv_freq

# CPU linear packing and heap trimming live in agentd.model.onednn; importable from here too.
from agentd.model.onednn import (  # noqa: F401
    ONEDNN_CACHE_ENTRIES,
    ONEDNN_CACHE_ENTRIES_BF16,
    PackedLinear,
    SharedWeightLinear,
    bound_onednn_caches,
    pack_linears,
    packing_unsupported,
    release_free_memory,
    shared_parameter_ids,
)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# The rotary table's length until the engine fits it to the context it serves (its cos and sin
# cost 8 bytes a position and rotary pair: 4 MiB for head size 128).
ROPE_POSITIONS_BEFORE_FIT = 8192


@dataclass
class AttentionMetadata:
    """How the flattened batch maps onto the pool; built once per step by the runner.

    Decode rows (one token per sequence) come first, then prefill chunks.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decode_seqs, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decode_seqs] int32
    prefill_block_tables: torch.Tensor  # [num_prefill_seqs, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefill_seqs + 1] int32
    prefill_seq_lens: torch.Tensor  # [num_prefill_seqs] int32


@dataclass(frozen=True)
class ModelDims:
    """The shape facts the runner needs, read from a transformers config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    attention_bias: bool
    o_proj_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None
    # q/k rows hold each head's rotary pairs interleaved (a llama-arch GGUF served as it ships,
    # agentd.model.gguf_model): rotary turns pairs (2i, 2i+1), not halves (i, i + D/2)
    rope_interleaved: bool = False

    @classmethod
    def from_config(cls, config) -> ModelDims:
        model_type = config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture {model_type!r} "
                f"({', '.join(getattr(config, 'architectures', None) or [])}); "
                f"agentd runs: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        bias = getattr(config, "attention_bias", False) or model_type == "qwen2"
        window = getattr(config, "sliding_window", None)
        if model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
            window = None
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            attention_bias=bool(bias),
            o_proj_bias=bool(getattr(config, "attention_bias", False)) and model_type != "qwen2",
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
            sliding_window=window,
            rope_interleaved=bool(getattr(config, "rope_interleaved", False)),
        )


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the config's RoPE type (transformers' math),
    or YaRN's for a context stretched past the model's own (agentd.model.context)."""
    params = getattr(config, "rope_parameters", None) or {}
    extension = extension_of(config)
    if extension is not None:
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return yarn_inv_freq(theta, head_dim, extension.factor, extension.trained_len)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        return inv_freq.float(), float(scaling)
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    factors = getattr(config, "rope_freq_factors", None)  # a GGUF's rope_freqs (Llama 3.x)
    if factors is not None:
        return 1.0 / (theta**exponents * torch.tensor(factors, dtype=torch.float32)), 1.0
    return 1.0 / (theta**exponents), 1.0


RopeTable = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) at a step's positions


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table indexed by absolute position (rotate-half convention)."""

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.inv_freq, self.scaling = rope_inv_freq(config, head_dim)  # float32, on the CPU
        self.fit(max_positions)

    @property
    def num_positions(self) -> int:
        return self.cos.shape[0]

    def fit(self, num_positions: int, device: torch.device | str | None = None) -> None:
        """Build the float32 table for positions ``[0, num_positions)`` on ``device``."""
        freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), self.inv_freq)
        cos, sin = freqs.cos() * self.scaling, freqs.sin() * self.scaling
        if device is not None:
            cos, sin = cos.to(device), sin.to(device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTable:
        """cos and sin at ``positions``, ``[T, 1, D/2]`` each: looked up once per step, used by
        every layer. In the activations' dtype, as transformers does (cos/sin are cast, not the
        inputs)."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))

    @staticmethod
    def apply(table: RopeTable, *tensors: torch.Tensor) -> list[torch.Tensor]:
        cos, sin = table
        out = []
        for x in tensors:
            x1, x2 = x.chunk(2, dim=-1)
            out.append(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
        return out

    @staticmethod
    def apply_interleaved(table: RopeTable, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`apply` for rows whose rotary pairs sit side by side: the same products on each
        pair, so the result is :meth:`apply`'s under the same permutation of the head dim."""
        cos, sin = table
        out = []
        for x in tensors:
            x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
            out.append(torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
                       .flatten(-2))
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Attention(nn.Module):
    native_ops = False  # rotary + KV write as one fused CPU call (agentd.kernels.cpu.fused)

    def __init__(self, dims: ModelDims, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.dims = dims
        self.q_size = dims.num_heads * dims.head_dim
        self.kv_size = dims.num_kv_heads * dims.head_dim
        self.qkv_proj = nn.Linear(dims.hidden_size, self.q_size + 2 * self.kv_size, device=device,
                                  bias=dims.attention_bias)
        self.o_proj = nn.Linear(self.q_size, dims.hidden_size, bias=dims.o_proj_bias, device=device)
        if dims.qk_norm:
            self.q_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps, device)
            self.k_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps, device)
        self.scale = dims.head_dim**-0.5

    def forward(self, x: torch.Tensor, rope: RopeTable, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        num_tokens, d = x.shape[0], self.dims
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, d.num_heads, d.head_dim)
        k = k.reshape(num_tokens, d.num_kv_heads, d.head_dim)
        v = v.reshape(num_tokens, d.num_kv_heads, d.head_dim)
        if d.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.native_ops:  # q and k rotated in place
            fused.rope_write_kv(q, k, v, rope[0].squeeze(1), rope[1].squeeze(1),
                                d.rope_interleaved, kv_cache, meta.slot_mapping)
        else:
            if d.rope_interleaved:
                q, k = RotaryEmbedding.apply_interleaved(rope, q, k)
            else:
                q, k = RotaryEmbedding.apply(rope, q, k)
            backend.write_kv(k, v, kv_cache, meta.slot_mapping)
        num_decode = meta.num_decode_tokens
        if num_decode == num_tokens:
            out = backend.decode(q, kv_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                 self.scale)
        elif num_decode == 0:
            out = backend.prefill(q, kv_cache, meta.prefill_block_tables,
                                  meta.prefill_query_start_loc, meta.prefill_seq_lens, self.scale)
        else:
            out = torch.cat([
                backend.decode(q[:num_decode], kv_cache, meta.decode_block_tables,
                               meta.decode_seq_lens, self.scale),
                backend.prefill(q[num_decode:], kv_cache, meta.prefill_block_tables,
                                meta.prefill_query_start_loc, meta.prefill_seq_lens, self.scale),
            ])
        return self.o_proj(out.reshape(num_tokens, self.q_size))


MLP_ROWS = 512  # rows per MLP piece: a bound on activation memory, not a speed knob


class MLP(nn.Module):
    native_ops = False  # SiLU(gate) * up as one fused CPU call

    def __init__(self, dims: ModelDims, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.intermediate_size = dims.intermediate_size
        self.gate_up_proj = nn.Linear(dims.hidden_size, 2 * dims.intermediate_size, bias=False,
                                      device=device)
        self.down_proj = nn.Linear(dims.intermediate_size, dims.hidden_size, bias=False,
                                   device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= MLP_ROWS:
            return self._rows(x)
        # A long prefill chunk's [rows, 2 * intermediate] activations are the step's largest
        # tensors (50 MB for 2,048 rows of the default model); in pieces they stay small and
        # the GEMMs keep their speed.
        out = torch.empty(x.shape[0], self.down_proj.out_features, dtype=x.dtype,
                          device=x.device)
        for start in range(0, x.shape[0], MLP_ROWS):
            out[start:start + MLP_ROWS] = self._rows(x[start:start + MLP_ROWS])
        return out

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_ops:
            return self.down_proj(fused.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, dims: ModelDims, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, device)
        self.self_attn = Attention(dims, device)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, device)
        self.mlp = MLP(dims, device)

    def forward(self, x: torch.Tensor, rope: RopeTable, kv_cache: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head over a flattened paged batch."""

    native_ops = False  # see use_native_ops

    def __init__(self, config, max_positions: int | None = None,
                 device: torch.device | str | None = None) -> None:
        """``device="meta"`` builds the shapes only, for :meth:`materialize` and a checkpoint
        load. The rotary table covers ``max_positions``, by default the model's context up to
        ``ROPE_POSITIONS_BEFORE_FIT``: a header may claim any context, and the engine fits the
        table to the one it serves (:meth:`fit_context`)."""
        super().__init__()
        self.dims = dims = ModelDims.from_config(config)
        # An explicit weight skips the random init (normal_ on meta would import torch._dynamo);
        # zeros, not empty: a model built off meta must not start from whatever memory held.
        self.embed_tokens = nn.Embedding(
            dims.vocab_size, dims.hidden_size,
            _weight=torch.zeros(dims.vocab_size, dims.hidden_size, device=device))
        self.layers = nn.ModuleList(DecoderLayer(dims, device) for _ in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, device)
        self.lm_head = nn.Linear(dims.hidden_size, dims.vocab_size, bias=False, device=device)
        self.tie_weights()
        self.rotary = RotaryEmbedding(
            config, dims.head_dim,
            max_positions or min(dims.max_position_embeddings, ROPE_POSITIONS_BEFORE_FIT))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """Returns final hidden states ``[num_tokens, hidden_size]`` (after the last norm)."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.table(positions, x.dtype)
        if self.native_ops:
            return self._fused_layers(x, rope, kv_caches, meta, backend)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, kv_cache, meta, backend)
        return self.norm(x)

    def use_native_ops(self) -> None:
        """Run the small per-layer ops of float32 CPU steps as fused C++ calls: each norm with
        the residual add before it, rotary + KV write, SiLU x up (agentd.kernels.cpu.fused;
        their torch references where the extension is unavailable). Equal to the plain layers
        up to fp32 rounding; pair it with the ``cpu`` attention backend."""
        self.native_ops = True
        for layer in self.layers:
            layer.self_attn.native_ops = layer.mlp.native_ops = True

    def _fused_layers(self, x: torch.Tensor, rope: RopeTable, kv_caches: list[torch.Tensor],
                      meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """The decoder layers with the residual stream apart: ``residual`` accumulates every
        layer's outputs in place, each norm is fused with the add before it."""
        residual = x
        norms = [(layer.input_layernorm, layer.post_attention_layernorm)
                 for layer in self.layers]
        first = norms[0][0]
        h = fused.add_rms_norm(None, residual, first.weight, first.eps)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            post = norms[i][1]
            h = fused.add_rms_norm(layer.self_attn(h, rope, kv_cache, meta, backend), residual,
                                   post.weight, post.eps)
            after = norms[i + 1][0] if i + 1 < len(norms) else self.norm
            h = fused.add_rms_norm(layer.mlp(h), residual, after.weight, after.eps)
        return h

    def fit_context(self, num_positions: int) -> None:
        """Rebuild the rotary table for positions ``[0, num_positions)``, in float32 whatever
        the weights' dtype, where the table is now: the context served, not the model's claim
        (a GGUF saying 2^32 - 1 would ask for a 16 GiB table)."""
        self.rotary.fit(num_positions, self.rotary.cos.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def materialize(self, device: torch.device | str) -> LlamaModel:
        """Uninitialised storage on ``device`` for every tensor a ``device="meta"`` build left
        on meta, for a checkpoint load to fill: ``to_empty``, without its cost (torch's meta
        ``empty_like`` imports sympy, ~0.4 s of every start)."""
        for module in self.modules():
            for name, param in module._parameters.items():
                if param is not None and param.is_meta:
                    module._parameters[name] = nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype, device=device),
                        requires_grad=param.requires_grad)
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_meta:
                    module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype,
                                                        device=device)
        self.tie_weights()
        return self

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings`` the LM head *is* the embedding matrix (one tensor, as in
        transformers), not a copy of it. Call again after ``to_empty``; :meth:`materialize`
        does."""
        if self.dims.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor]
                           | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named weights in, fusing q/k/v and gate/up. ``state`` is a mapping
        or an iterable of ``(name, tensor)`` pairs, consumed one at a time."""
        self.tie_weights()
        own = self.state_dict()
        rows_filled: dict[str, int] = {}
        tied = self.dims.tie_word_embeddings
        for name, tensor in state.items() if isinstance(state, Mapping) else state:
            key = name.removeprefix("model.")
            if key.endswith("rotary_emb.inv_freq") or (tied and key == "lm_head.weight"):
                continue
            target_key, rows = self._fused_target(key)
            if target_key not in own:
                raise ValueError(f"unexpected weight {name!r} in the checkpoint")
            target = own[target_key] if rows is None else own[target_key][rows]
            if target.shape != tensor.shape:
                raise ValueError(f"weight {name}: expected {tuple(target.shape)}, "
                                 f"got {tuple(tensor.shape)}")
            target.copy_(tensor)
            rows_filled[target_key] = rows_filled.get(target_key, 0) + target.shape[0]
        if tied:
            rows_filled["lm_head.weight"] = rows_filled.get("embed_tokens.weight", 0)
        elif "lm_head.weight" not in rows_filled:
            raise ValueError("checkpoint has no lm_head.weight and does not tie embeddings")
        missing = [k for k, t in own.items() if rows_filled.get(k) != t.shape[0]]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}")

    def _fused_target(self, key: str) -> tuple[str, slice | None]:
        """Where an unfused transformers weight lands: the fused key and its row range."""
        d = self.dims
        q_size, kv_size = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        fused = {
            "q_proj": ("qkv_proj", 0, q_size),
            "k_proj": ("qkv_proj", q_size, kv_size),
            "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
            "gate_proj": ("gate_up_proj", 0, d.intermediate_size),
            "up_proj": ("gate_up_proj", d.intermediate_size, d.intermediate_size),
        }
        for part, (name, start, size) in fused.items():
            if f".{part}." in key:
                return key.replace(part, name), slice(start, start + size)
        return key, None
