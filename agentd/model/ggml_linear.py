"""Linear layers and an embedding over a GGUF's quantized rows, as the file stores them.

Each module holds ggml block rows (uint8 ``[rows, row_bytes]``, usually a view of the memory-mapped
file) and the name of their format; its product is one call into ``agentd.kernels.cpu``, which
quantizes the float32 activations once per call and multiplies the blocks in place. The model code
sees ``in_features``/``out_features`` and a float32 result, never a format.

Invariant: no module here makes or keeps a float copy of its weight; the only float tensor one
holds is an optional bias.
"""

from __future__ import annotations

import torch
from torch import nn

from agentd.kernels import cpu as ggml


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` in one ggml block format (``type_name``)."""

    def __init__(self, weight: torch.Tensor, type_name: str, in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.type_name = type_name
        self.in_features, self.out_features = in_features, weight.shape[0]
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = ggml.linear(x.contiguous(), self.weight, self.type_name)
        return out if self.bias is None else out.add_(self.bias)

    def weight_bytes(self) -> int:
        return _nbytes(self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.type_name}"


class FusedQuantLinear(nn.Module):
    """Several layers over the same input, side by side in the output (q/k/v, gate/up), each part
    in its own format as the file has it (Q4_K_M keeps some ``attn_v`` in Q6_K beside Q4_K
    ``attn_q``/``attn_k``): one call, so the activations are quantized once per format."""

    def __init__(self, parts: list[tuple[torch.Tensor, str]], in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.type_names = [type_name for _, type_name in parts]
        self.in_features = in_features
        self.out_features = sum(weight.shape[0] for weight, _ in parts)
        for i, (weight, _) in enumerate(parts):
            self.register_buffer(f"weight_{i}", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def parts(self) -> list[tuple[torch.Tensor, str]]:
        return [(getattr(self, f"weight_{i}"), t) for i, t in enumerate(self.type_names)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = ggml.linear_multi(x.contiguous(), self.parts())
        return out if self.bias is None else out.add_(self.bias)

    def weight_bytes(self) -> int:
        return sum(_nbytes(weight) for weight, _ in self.parts())

    def extra_repr(self) -> str:
        rows = "+".join(str(weight.shape[0]) for weight, _ in self.parts())
        return (f"in_features={self.in_features}, out_features={rows}, "
                f"{'+'.join(self.type_names)}")


class QuantEmbedding(nn.Module):
    """Token embeddings looked up from quantized rows (each id's row dequantized on its own)."""

    def __init__(self, weight: torch.Tensor, type_name: str, embedding_dim: int) -> None:
        super().__init__()
        self.type_name = type_name
        self.num_embeddings, self.embedding_dim = weight.shape[0], embedding_dim
        self.register_buffer("weight", weight, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ggml.get_rows(self.weight, self.type_name, ids.reshape(-1), self.embedding_dim)

    def weight_bytes(self) -> int:
        return _nbytes(self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.type_name}"


QUANT_MODULES = (QuantLinear, FusedQuantLinear, QuantEmbedding)
