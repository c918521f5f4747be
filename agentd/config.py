"""Engine configuration: one frozen dataclass, validated on construction.

Invariant: a config never changes after it is built. Values that are only known at run time
(the number of KV blocks, the model's EOS ids) are passed to constructors, never written back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20,
               "mib": 2**20, "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Parse a byte size such as ``512MiB``, ``2GiB`` or ``1073741824`` into bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse size {text!r}: use e.g. 512MiB, 2GiB or a byte count")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str | float | int) -> float:
    """Parse a duration such as ``90s``, ``15m``, ``1h30m`` or ``2d`` into seconds."""
    if isinstance(text, int | float):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smhd])", str(text).strip().lower())
    if not parts or "".join(a + b for a, b in parts) != re.sub(r"\s+", "", str(text).lower()):
        raise ValueError(f"cannot parse duration {text!r}: use e.g. 90s, 15m, 1h30m or 2d")
    return sum(float(num) * _DURATION_UNITS[unit] for num, unit in parts)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt-lookup speculative decoding (:mod:`agentd.engine.spec_decode`).

    ``method`` "ngram" drafts up to ``num_tokens`` tokens per step from the longest match
    (``ngram_max`` down to ``ngram_min`` tokens) of a request's last tokens earlier in its own
    prompt and output; "off" never drafts. Drafts ride only on steps of at most ``max_num_seqs``
    running requests: beyond that the step is compute-bound and extra rows cost their full price.
    """

    method: str = "ngram"
    num_tokens: int = 8
    ngram_max: int = 3
    ngram_min: int = 2
    max_num_seqs: int = 4

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "off"):
            raise ValueError(f"speculative must be ngram or off, not {self.method!r}")
        if not 1 <= self.num_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be in [1, 64], not {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"prompt_lookup_min ({self.ngram_min}) must be >= 1 and <= prompt_lookup_max "
                f"({self.ngram_max})"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"speculative_max_num_seqs must be >= 1, not {self.max_num_seqs}")


@dataclass(frozen=True)
class KVEventsConfig:
    """Where the events go: ``endpoint`` (bound, e.g. ``tcp://127.0.0.1:5557``; ``tcp://*:5557``
    for every interface), an optional replay ``replay_endpoint``, and the topic
    ``kv@<replica_id>@<model>`` (llm-d's form)."""

    endpoint: str
    replay_endpoint: str | None = None
    replica_id: str = "agentd"
    buffer_batches: int = 10_000  # batches kept for replay

    def __post_init__(self) -> None:
        for name, value in (("kv_events", self.endpoint),
                            ("kv_events_replay", self.replay_endpoint)):
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{name} must be a ZMQ endpoint such as tcp://127.0.0.1:5557, "
                                 f"not {value!r}")
        if self.buffer_batches < 1:
            raise ValueError("buffer_batches must be at least 1")

    def topic(self, model_name: str) -> str:
        return f"kv@{self.replica_id}@{model_name}"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start. ``None`` means "pick a default at load time"."""

    model: str | None = None
    tokenizer: str | None = None
    device: str = "auto"
    dtype: str = "auto"  # activations and attention (and by default the weights; KV: auto)
    weights: str | None = None  # linear layers' format; None: a .gguf's own blocks ("gguf") on
    # the CPU with float32 activations (the default model's too), else the same as dtype
    # (agentd.model.build.serves_gguf)
    prefill_weights: str = "keep"  # low-precision weights' big products: "keep" a dense twin, or
    # "dequantize" per call (no second copy; slower prefill)
    block_size: int = 16
    # None: max_model_len tokens for each of max_num_seqs sequences within a share of the free
    # memory (agentd.engine.kv_sizing); a size sets the pool
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"  # the pool's dtype; attention math stays fp32 (auto: kv_sizing)
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    # The most prompt tokens one request runs in a step: a long prefill leaves the rest of the
    # budget to short requests that arrive meanwhile (see agentd.engine.scheduler)
    long_prefill_chunk: int = 512
    max_model_len: int | None = None
    # Without --max-model-len: stretch a model whose context is shorter to this many tokens
    # (YaRN, agentd.model.context), as the memory allows. `agentd start` sets it for the default
    # model, whose 8,192 tokens hold no coding agent's first prompt.
    min_context: int | None = None
    enable_prefix_caching: bool = True
    max_pinned_fraction: float = 0.5
    attention_backend: str = "auto"
    cpu_linear: str = "onednn"  # "onednn" (packed weights) or "torch" (F.linear, MKL)
    seed: int = 0
    num_threads: int | None = None
    mlock: bool = False  # lock a served GGUF's mapped weights in RAM (llama.cpp's --mlock)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    jump_forward: bool = True  # append the tokens a grammar forces without a step each
    kv_events: KVEventsConfig | None = None  # publish the pool's KV events (kv_publisher)
    # the disk tier under the pool (agentd.engine.kv_tier): None keeps blocks in memory only
    kv_disk_dir: str | None = None
    kv_disk_budget_bytes: int | None = None  # None: a quarter of the free disk, <= 100 GiB
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def context_target(self) -> int | None:
        """The context the model is stretched to when its own is shorter (None: its own)."""
        return self.max_model_len or self.min_context

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, not {self.dtype}")
        self._check_weights()
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, not {self.block_size}")
        self._check_kv_cache()
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, not {self.max_num_seqs}")
        if self.long_prefill_chunk < 1:
            raise ValueError(f"long_prefill_chunk must be >= 1, not {self.long_prefill_chunk}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= block_size "
                f"({self.block_size})"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, not {self.max_model_len}")
        if self.min_context is not None and self.min_context < 1:
            raise ValueError(f"min_context must be >= 1, not {self.min_context}")
        if not 0.0 <= self.max_pinned_fraction <= 1.0:
            raise ValueError(
                f"max_pinned_fraction must be within [0, 1], not {self.max_pinned_fraction}"
            )
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch, cpu or triton, not "
                f"{self.attention_backend!r}"
            )
        if self.cpu_linear not in ("onednn", "torch"):
            raise ValueError(f"cpu_linear must be onednn or torch, not {self.cpu_linear!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, not {self.num_threads}")

    def _check_kv_cache(self) -> None:
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.kv_disk_budget_bytes is not None and self.kv_disk_budget_bytes < 0:
            raise ValueError("kv_disk_budget_bytes must not be negative")
        if self.kv_cache_dtype not in ("auto", "float32", "float16", "bfloat16", "q8_0"):
            raise ValueError(f"kv_cache_dtype must be auto, float32, float16, bfloat16 or q8_0, "
                             f"not {self.kv_cache_dtype!r}")

    def _check_weights(self) -> None:
        formats = ("auto", "float32", "bfloat16", "float16", "int8", "int4", "gguf")
        if self.prefill_weights not in ("keep", "dequantize"):
            raise ValueError(f"prefill_weights must be keep or dequantize, not "
                             f"{self.prefill_weights!r}")
        if self.weights is None:
            return
        if self.weights not in formats:
            raise ValueError(f"weights must be one of {', '.join(formats)}, not {self.weights!r}")
        if self.device.startswith("cuda") and self.weights not in ("auto", self.dtype):
            raise ValueError("weights other than the dtype run on the CPU only; on CUDA leave "
                             "weights unset")
        if self.weights == "float32" and self.dtype not in ("auto", "float32"):
            raise ValueError("weights float32 needs dtype float32: weights are never stored "
                             "wider than the activations")
        if self.weights == "gguf" and self.dtype not in ("auto", "float32"):
            raise ValueError("weights gguf multiplies the file's blocks by float32 activations; "
                             "leave dtype auto (or float32) with weights gguf")
