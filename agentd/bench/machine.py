"""One line that says which CPU a benchmark ran on: every benchmark prints it beside its figures
(the AVX2 and AVX-512 paths differ several-fold)."""

from __future__ import annotations

import subprocess

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16",
             "amx_int8", "amx_tile")


def cpu_line() -> str:
    """The CPU's model name, its lscpu flags of interest, torch's capability and threads."""
    import torch

    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        lscpu = ""
    model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines()
                  if ln.startswith("Model name")), "?")
    have = next((ln.split(":", 1)[1].split() for ln in lscpu.splitlines()
                 if ln.startswith("Flags")), [])
    isa = " ".join(f for f in ISA_FLAGS if f in have)
    return (f"CPU: {model}; lscpu flags: {isa or 'none of ' + ', '.join(ISA_FLAGS)}; torch "
            f"{torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} threads")
